"""dp.TokenWindows and dp.TokenBatches: token windows from a uint16 file through grain, each
process reading its own rows, global batch s a pure function of s.

Every check is by sample id (the window's index, carried through the pipeline into the
placed batch the step receives) against a NumPy oracle written from the file and the seed
alone (tests/multihost/workers/token_model.py). Resuming after a crash, on another device
count and strategy, is checked here in one process; after a SIGKILL and on fewer processes in
tests/multihost/test_grain_data.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import dp
from jaxcoll.dp.data.grain import process_rows
from tests.helpers import mesh_1d
from tests.multihost.workers import token_model as tm

STEPS = 6


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tokens") / "train.bin"
    tm.write_tokens(p)
    return p


def _fit(trainer, path, steps, ckpt=None, state=None, fail_at=None):
    state = trainer.init(tm.init_params(), jax.random.key(0)) if state is None else state
    callbacks = []
    if fail_at is not None:

        def crash(step, metrics):
            if step == fail_at:
                raise RuntimeError("crash")

        callbacks.append(crash)
    checkpoint = None if ckpt is None else dp.Checkpointer(ckpt, every=2)
    return trainer.fit(
        state,
        tm.data(path, trainer),
        steps=steps,
        checkpoint=checkpoint,
        callbacks=callbacks,
        progress=False,
    )


def _ids(seen):
    return {s: np.array([rows[r] for r in sorted(rows)]) for s, rows in seen.items()}


def test_windows_and_batches_match_the_numpy_oracle(path):
    windows = dp.TokenWindows(path, tm.BLOCK, stride=tm.STRIDE)
    assert len(windows) == (tm.TOKENS - tm.BLOCK - 1) // tm.STRIDE + 1
    tokens = np.fromfile(path, np.uint16)
    w = windows[17]
    np.testing.assert_array_equal(w["x"], tokens[85:93])
    np.testing.assert_array_equal(w["y"], tokens[86:94])
    assert w["id"] == 17 and w["x"].dtype == np.int32
    data = tm.data(path, None)
    # Steps 0, 24 and 25 (epoch 0 ends inside batch 24: 399 = 24 * 16 + 15) and far on.
    for s in (0, 1, 24, 25, 100):
        want = tm.oracle_ids(s)
        np.testing.assert_array_equal(data.ids(s), want)
        batch = data[s]
        np.testing.assert_array_equal(batch["id"], want)
        np.testing.assert_array_equal(batch["x"], tm.oracle_x(path, want))
    epoch0 = np.concatenate([tm.oracle_ids(s) for s in range(24)] + [tm.oracle_ids(24)[:15]])
    assert sorted(epoch0) == list(range(len(windows)))  # every window once an epoch
    ordered = dp.TokenBatches(windows, tm.BATCH, shuffle=False)
    np.testing.assert_array_equal(ordered[1]["id"], np.arange(16, 32))


def test_the_iterator_yields_placed_batches_and_its_state_is_the_step(path):
    trainer = tm.trainer(mesh_1d(8, "data"))
    data = tm.data(path, trainer)
    it = data.iter_from(3)
    for s in (3, 4):
        batch = next(it)
        assert batch["x"].sharding.is_equivalent_to(trainer.batch_sharding, 2)
        np.testing.assert_array_equal(jax.device_get(batch["id"]), tm.oracle_ids(s))
    assert it.get_state() == {"next_index": 5}
    it.set_state({"next_index": 30})
    np.testing.assert_array_equal(jax.device_get(next(it)["id"]), tm.oracle_ids(30))
    # The Trainer uses a placed batch as it is.
    placed = trainer.shard_batch(batch)
    assert placed["x"] is batch["x"]
    # Iterating gives one epoch's worth of batches (399 // 16), e.g. for evaluation.
    assert len(data) == 24
    ids = [jax.device_get(b["id"]) for b in data]
    assert len(ids) == 24
    np.testing.assert_array_equal(ids[23], tm.oracle_ids(23))
    state = trainer.init(tm.init_params(), jax.random.key(0))
    assert set(trainer.evaluate(state, data)) == {"loss"}


def test_rows_over_a_model_axis_and_a_batch_that_does_not_split(path):
    # A (data 4, tensor 2) mesh: the batch split 4 ways, each quarter on 2 devices; this one
    # process holds them all (tests/multihost/test_grain_data.py: a process's own rows).
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    sharding = NamedSharding(mesh, P("data"))
    assert list(process_rows(sharding, 16)) == list(range(16))
    data = dp.TokenBatches(dp.TokenWindows(path, 8), 16, sharding=sharding)
    batch = next(data.iter_from(2))
    assert batch["x"].sharding == sharding
    np.testing.assert_array_equal(jax.device_get(batch["x"]), data[2]["x"])
    with pytest.raises(ValueError, match=r"TokenBatches: batch_size=12 does not split evenly"):
        dp.TokenBatches(dp.TokenWindows(path, 8), 12, sharding=NamedSharding(mesh_1d(8), P("x")))
    with pytest.raises(ValueError, match=r"TokenBatches: batch_size=6 does not split evenly"):
        dp.TokenBatches(dp.TokenWindows(path, 8), 6, sharding=sharding)


def test_fit_resumes_exactly_after_a_crash_and_on_another_layout(path, tmp_path):
    # Uninterrupted: 8 devices, DDP.
    whole = tm.trainer(mesh_1d(8, "data"))
    want_state, _ = _fit(whole, path, STEPS)
    assert _ids(whole.seen).keys() == set(range(STEPS))
    for s, ids in _ids(whole.seen).items():
        np.testing.assert_array_equal(ids, tm.oracle_ids(s), err_msg=f"step {s}")

    # A run that crashes after step 3 (checkpoints every 2 steps) ...
    ckpt = tmp_path / "ckpt"
    first = tm.trainer(mesh_1d(8, "data"))
    with pytest.raises(RuntimeError, match="crash"):
        _fit(first, path, STEPS, ckpt=ckpt, fail_at=3)
    # ... restarted on 4 devices with FSDP: from step 2's checkpoint, the same ids.
    again = tm.trainer(mesh_1d(4, "data"), sync=dp.sync.FSDP())
    state, history = _fit(again, path, STEPS, ckpt=ckpt)
    assert [h["step"] for h in history] == [3, 4, 5, 6]
    assert sorted(again.seen) == [2, 3, 4, 5]
    for s, ids in _ids(again.seen).items():
        np.testing.assert_array_equal(ids, tm.oracle_ids(s), err_msg=f"step {s}")
    got = again.host_params(state)
    for k, v in whole.host_params(want_state).items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_bad_arguments_are_named(path, tmp_path):
    with pytest.raises(ValueError, match=r"TokenWindows: path=.* is not a file"):
        dp.TokenWindows(tmp_path / "missing.bin", 8)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match=r"has 7 bytes, not a whole number of uint16"):
        dp.TokenWindows(odd, 2)
    with pytest.raises(ValueError, match=r"fewer than one window \(block_size \+ 1 = 2001\)"):
        dp.TokenWindows(path, 2000)
    with pytest.raises(TypeError, match=r"TokenWindows: dtype=float32 is not a token type"):
        dp.TokenWindows(path, 8, dtype=np.float32)
    with pytest.raises(TypeError, match=r"TokenBatches: source must be a grain data source"):
        dp.TokenBatches(3, 16)
    with pytest.raises(TypeError, match=r"TokenBatches: sharding must be a"):
        dp.TokenBatches(dp.TokenWindows(path, 8), 16, sharding=P("data"))
    with pytest.raises(ValueError, match=r"TokenBatches.iter_from: step=-1 must be 0 or more"):
        dp.TokenBatches(dp.TokenWindows(path, 8), 16).iter_from(-1)
