"""dp.TokenBatches across processes (tests/multihost/workers/grain_train.py): each process
reads only its own rows; a job SIGKILLed and restarted from its checkpoint, then resumed on
fewer processes (2 x 4 devices, then 1 x 4), trains on exactly the window ids an
uninterrupted run trains on, step by step and row by row (a NumPy oracle from the file and
the seed), and ends at its params."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxcoll import dp
from tests.helpers import mesh_1d

from ._launch import launch, survivors
from .workers import token_model as tm


def _seen(out) -> dict[str, dict[int, dict[int, int]]]:
    """``{"p{k}_r{restart}": {step: {row: id}}}`` from the worker's files."""
    seen = {}
    for f in sorted(out.glob("ids_*.json")):
        steps = json.loads(f.read_text())
        seen[f.stem[4:]] = {
            int(s): {int(r): i for r, i in rows.items()} for s, rows in steps.items()
        }
    return seen


@pytest.mark.timeout(300)
def test_a_killed_job_and_one_on_fewer_processes_see_the_uninterrupted_ids(tmp_path):
    tokens, ckpt = tmp_path / "train.bin", tmp_path / "ckpt"
    tm.write_tokens(tokens)
    a, b = tmp_path / "a", tmp_path / "b"
    # 2 processes x 4 devices to step 8; process 1 is SIGKILLed after step 5 in the first run
    # (checkpoints every 2 steps: step 2's is written by then, step 4's may be).
    job = launch(
        ["--nprocs", "2", "--devices-per-proc", "4", "--max-restarts", "1"],
        "grain_train.py",
        [str(tokens), str(a), str(ckpt), "8", "5"],
        timeout=200,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert "process 1 (pid" in job.stderr and "was killed by SIGKILL first" in job.stderr
    assert "restarting all 2 process(es) (restart 1 of 1)" in job.stderr
    # ... then 1 process x 4 devices from step 8's checkpoint to step 12.
    job2 = launch(
        ["--nprocs", "1", "--devices-per-proc", "4"],
        "grain_train.py",
        [str(tokens), str(b), str(ckpt), "12", "0"],
        timeout=200,
    )
    assert job2.returncode == 0, job2.stderr[-4000:]
    assert "process 0: finished at step 12 on 1 x 4 devices, rows 0..15, 4 steps" in job2.stdout
    assert survivors(job.token) == [] and survivors(job2.token) == []

    seen = {**{f"a_{k}": v for k, v in _seen(a).items()}, **_seen(b)}
    # Every row any process trained on holds the oracle's window, whichever run it was.
    for name, steps in seen.items():
        for s, rows in steps.items():
            want = tm.oracle_ids(s)
            assert rows == {r: int(want[r]) for r in rows}, (name, s)
    # In 2 x 4, each process read its own half of every batch, and nothing else.
    for k, half in ((0, range(0, 8)), (1, range(8, 16))):
        assert all(sorted(rows) == list(half) for rows in seen[f"a_p{k}_r1"].values())
    # The restart resumed from a checkpoint (step 2 or 4), not from scratch, and ran to 8.
    resumed = sorted(seen["a_p0_r1"])
    assert resumed[0] in (2, 4) and resumed == list(range(resumed[0], 8))
    assert sorted(seen["a_p1_r1"]) == resumed
    # 1 x 4: steps 8 to 11, whole batches.
    assert sorted(seen["p0_r0"]) == [8, 9, 10, 11]
    assert all(sorted(rows) == list(range(16)) for rows in seen["p0_r0"].values())

    # The uninterrupted run, here on 8 devices: its ids are the oracle's, and the resumed
    # job ends at its params (gloo sums in another order: float32 rounding).
    whole = tm.trainer(mesh_1d(8, "data"))
    state = whole.init(tm.init_params(), jax.random.key(0))
    state, _ = whole.fit(state, tm.data(tokens, whole), steps=12, progress=False)
    for s, rows in whole.seen.items():
        assert rows == dict(enumerate(int(i) for i in tm.oracle_ids(s))), s
    got = np.load(b / "params.npz")
    for k, v in whole.host_params(state).items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert isinstance(tm.data(tokens, None), dp.TokenBatches)
