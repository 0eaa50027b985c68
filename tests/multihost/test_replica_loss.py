"""dp.Survivor: a job loses a data replica (SIGKILL) and trains on without a restart.

2 processes x 4 CPU devices, HSDP ``dp.Layout(replicate=2, shard=4)`` (replica = process),
every process started by ``_launch.start_each`` (``jaxcoll-run`` would end the job when one
dies) with ``JAXCOLL_RECOVERABLE=1`` (3 s heartbeat) and
``--xla_cpu_collective_timeout_seconds=10``. Process 1 SIGKILLs itself instead of running
step 3; process 0 runs step 3 again on its own 4 devices and goes on to step 8
(tests/multihost/workers/replica_loss.py). The oracle: plain JAX on one device, SGD over the
same global batches.
"""

from __future__ import annotations

import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcoll import dp

from ._launch import free_port, start_each, survivors

KILL_STEP, STEPS, LR = 3, 8, 0.1
RESUME_BOUND_S = 30


def _oracle(init: dict, batches: list[dict]) -> tuple[dict, list[float]]:
    """One device, the global batch each step: the params after every step and the losses."""

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)

    params = {k: jnp.asarray(v) for k, v in init.items()}
    losses = []
    for b in batches:
        value, g = jax.value_and_grad(loss)(params, b)
        losses.append(float(value))
        params = {k: params[k] - LR * g[k] for k in params}
    return {k: np.asarray(v) for k, v in params.items()}, losses


def _run(out, nprocs: int, devices: int, victim: int, replicate: int, shard: int, rejoin=False):
    """Run the job; with ``rejoin``, start a replacement for the victim once process 0 has
    gone on without it. Return the exit codes (the replacement's last) and the logs."""
    args = [str(out), str(KILL_STEP), str(STEPS), str(victim), str(replicate), str(shard)]
    options = {
        "env": {"JAXCOLL_RECOVERABLE": "1"},
        "xla_flags": "--xla_cpu_collective_timeout_seconds=10",
        "logs": str(out),
        "coordinator": f"127.0.0.1:{free_port()}",
    }
    mode = ["rejoin"] if rejoin else []
    popens, token = start_each(nprocs, devices, "replica_loss.py", args + mode, **options)
    deadline = time.monotonic() + 150
    try:
        if rejoin:
            record = out / "p0.json"
            while time.monotonic() < deadline:
                if record.exists() and json.loads(record.read_text())["recoveries"]:
                    break
                time.sleep(0.2)
            (out / "started").write_text(repr(time.time()))
            popens += start_each(
                nprocs,
                devices,
                "replica_loss.py",
                [*args, "replacement"],
                ids=[victim],
                token=token,
                tag="r",
                **options,
            )[0]
        for p in popens:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for pid in survivors(token):  # nothing outlives the test
            os.kill(pid, signal.SIGKILL)
    logs = {k: (out / f"p{k}.log").read_text() for k in range(nprocs)}
    if rejoin:
        logs["r"] = (out / f"p{victim}r.log").read_text()
    return [p.returncode for p in popens], logs


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "nprocs,devices,victim,survivors_",
    [(2, 4, 1, (0,)), (4, 2, 3, (0, 1))],
    ids=["2x4", "4x2"],
)
def test_survivor_trains_on_after_a_replica_dies(tmp_path, nprocs, devices, victim, survivors_):
    codes, logs = _run(tmp_path, nprocs, devices, victim, replicate=2, shard=4)
    assert codes[victim] == -signal.SIGKILL, codes
    for k in survivors_:
        assert codes[k] == 0, (k, codes, logs[k][-3000:])
    killed = float((tmp_path / "killed").read_text())
    # A process alive whose replica (processes 2 and 3 in 4 x 2) lost the victim drops out.
    orphans = [k for k in range(nprocs) if k != victim and k not in survivors_]
    for k in orphans:
        events = json.loads((tmp_path / f"p{k}.json").read_text())
        assert "its data replica lost process(es) [3]" in events["orphan"], events

    with np.load(tmp_path / f"p{survivors_[0]}.npz") as data:
        init = {k[5:]: data[k] for k in data.files if k.startswith("init/")}
        batches = [
            {name: data[f"batch/{i}/{name}"] for name in ("x", "y", "id")} for i in range(STEPS)
        ]
    expect, losses = _oracle(init, batches)
    rows_before = 16 // (nprocs * devices)  # rows per device on the whole mesh
    rows_after = 16 // (len(survivors_) * devices)
    records = {k: json.loads((tmp_path / f"p{k}.json").read_text()) for k in range(nprocs)}
    # Before the loss every device of the whole mesh took rows_before rows: together (the
    # victim's records included, written after each of its steps) the step's global batch.
    for s in range(KILL_STEP):
        got = [
            i
            for ev in records.values()
            for st, rows, ids in ev["seen"]
            if st == s and rows == rows_before
            for i in ids
        ]
        assert sorted(set(got)) == sorted(batches[s]["id"].tolist()), (s, got)
    for k in survivors_:
        events = records[k]
        steps = events["steps"]
        # Every step once, in order, state.step counting on: none skipped or repeated.
        assert [s[0] for s in steps] == list(range(STEPS)), steps
        assert [s[1] for s in steps] == list(range(1, STEPS + 1)), steps
        np.testing.assert_allclose([s[2] for s in steps], losses, rtol=1e-5, atol=1e-6)
        # The lost step was run again on the smaller mesh, and completed soon after the kill.
        resumed = steps[KILL_STEP][3] - killed
        print(f"process {k}: step {KILL_STEP} done {resumed:.2f} s after the kill")
        assert 0 < resumed < RESUME_BOUND_S, resumed
        ((step, dropped, replicas, _),) = events["recoveries"]
        assert (step, replicas) == (KILL_STEP, 1), events["recoveries"]
        assert victim in dropped and k not in dropped, dropped
        # Rows per device: rows_after from the lost step on (rows_before at that step: its
        # failed try).
        for s, rows, _ in events["seen"]:
            assert rows == rows_after or (rows == rows_before and s <= KILL_STEP), (s, rows)
    # The final params (each survivor's shards of them) equal one device's.
    for name, value in expect.items():
        got = np.full(value.shape, np.nan, np.float32)
        for k in survivors_:
            with np.load(tmp_path / f"p{k}.npz") as data:
                mine = data[f"final/{name}"]
            got = np.where(np.isnan(mine), got, mine)
        np.testing.assert_allclose(got, value, rtol=0, atol=1e-6, err_msg=name)
    # From the lost step on, the kept replica's devices took every row of each step.
    for s in range(KILL_STEP, STEPS):
        got = [
            i
            for k in survivors_
            for st, rows, ids in records[k]["seen"]
            if st == s and rows == rows_after
            for i in ids
        ]
        assert sorted(set(got)) == sorted(batches[s]["id"].tolist()), (s, got)


@pytest.mark.timeout(180)
def test_a_replacement_rejoins_and_trains_on_with_the_survivor(tmp_path):
    """2 x 4: process 1 dies at step 3, process 0 goes on alone; a replacement process 1
    starts, process 0 (``rejoin=True``) admits its replica at a step boundary and sends it
    the state; both train to the end, equal to one device."""
    codes, logs = _run(tmp_path, 2, 4, 1, replicate=2, shard=4, rejoin=True)
    assert codes == [0, -signal.SIGKILL, 0], (codes, logs[0][-2000:], logs["r"][-3000:])
    with np.load(tmp_path / "p0.npz") as data:
        init = {k[5:]: data[k] for k in data.files if k.startswith("init/")}
        batches = [
            {name: data[f"batch/{i}/{name}"] for name in ("x", "y", "id")} for i in range(STEPS)
        ]
    expect, losses = _oracle(init, batches)
    first = json.loads((tmp_path / "p0.json").read_text())
    back = json.loads((tmp_path / "p1r.json").read_text())
    joined, _ = back["joined_at"]
    assert KILL_STEP < joined < STEPS, back["joined_at"]
    started = float((tmp_path / "started").read_text())
    print(
        f"replacement: started {started - float((tmp_path / 'killed').read_text()):.2f} s "
        f"after the kill, joined the job {back['joined_at'][1] - started:.2f} s after its start "
        f"(state at step {joined}), its first step done {back['steps'][0][3] - started:.2f} s "
        f"after its start"
    )
    # Process 0: every step once; alone from the lost step until the replacement joined.
    assert [s[0] for s in first["steps"]] == list(range(STEPS))
    assert [s[1] for s in first["steps"]] == list(range(1, STEPS + 1))
    replicas = [2] * KILL_STEP + [1] * (joined - KILL_STEP) + [2] * (STEPS - joined)
    assert [s[4] for s in first["steps"]] == replicas, first["steps"]
    # The replacement: the job's state at the step it joined, then the same steps.
    assert [s[0] for s in back["steps"]] == list(range(joined, STEPS)), back["steps"]
    for events, start in ((first, 0), (back, joined)):
        np.testing.assert_allclose(
            [s[2] for s in events["steps"]], losses[start:], rtol=1e-5, atol=1e-6
        )
    # Once both replicas train again, each device takes 2 rows, and together every row.
    for s in range(joined, STEPS):
        got = [i for ev in (first, back) for st, rows, ids in ev["seen"] if st == s for i in ids]
        assert sorted(set(got)) == sorted(batches[s]["id"].tolist()), (s, got)
    for name in ("p0", "p1r"):
        with np.load(tmp_path / f"{name}.npz") as data:
            for key, value in expect.items():
                np.testing.assert_allclose(data[f"final/{key}"], value, rtol=0, atol=1e-6)


def _loss(p, b, rng):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2), {}


def test_survivor_in_one_process_steps_as_one_device():
    """Nothing to lose in one process (8 devices): its steps are the Trainer's, and a batch
    function gets the step number."""
    rng = np.random.default_rng(0)
    init = {
        "w1": rng.standard_normal((4, 16)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": rng.standard_normal((16, 1)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }
    batches = [
        {"x": rng.standard_normal((16, 4)).astype(np.float32), "y": rng.random((16, 1))}
        for _ in range(3)
    ]
    survivor = dp.Survivor(_loss, optax.sgd(LR), layout=dp.Layout(replicate=2, shard=4))
    assert survivor.mesh.shape == {"replicate": 2, "shard": 4}
    state = survivor.init(init, jax.random.key(0))
    asked = []
    for _ in range(3):
        state, metrics = survivor.step(state, lambda i: asked.append(i) or batches[i])
    assert asked == [0, 1, 2] and int(state.step) == 3 and survivor.recoveries == []
    expect, losses = _oracle(init, [{**b, "id": None} for b in batches])
    assert float(metrics["loss"]) == pytest.approx(losses[-1], rel=1e-5)
    for name, value in expect.items():
        np.testing.assert_allclose(np.asarray(state.params[name]), value, rtol=0, atol=1e-6)


def test_survivor_refuses_layouts_it_cannot_shrink():
    with pytest.raises(ValueError, match=r"has no replicate axis.*replicate= a degree above 1"):
        dp.Survivor(_loss, optax.sgd(LR), layout=dp.Layout(shard=8))
    with pytest.raises(TypeError, match=r"layout must be a dp.Layout given by degrees"):
        dp.Survivor(_loss, optax.sgd(LR), layout=dp.Layout(replicate="data"))
    with pytest.raises(ValueError, match=r"timeout=0 must be a positive number"):
        dp.Survivor(_loss, optax.sgd(LR), layout=dp.Layout(replicate=8), timeout=0)
    with pytest.raises(TypeError, match=r"sync=DiLoCo\(...\) keeps one state per replica"):
        dp.Survivor(
            _loss, optax.sgd(LR), layout=dp.Layout(replicate=8), sync=dp.sync.DiLoCo(every=2)
        )
