"""``jaxcoll-run --recoverable``: the launcher goes on when a process other than 0 dies.

The real launcher (``python -m jaxcoll.run``) runs tests/multihost/workers/replica_loss.py
(through run_recoverable.py, which picks the replacement's mode from the launcher's
``JAXCOLL_REPLACEMENT``): 2 processes x 4 CPU devices, HSDP ``dp.Layout(replicate=2,
shard=4)``, process 1 SIGKILLs itself instead of running step 3. The oracle: plain JAX on one
device, SGD over the same global batches (tests/multihost/test_replica_loss.py's).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re

import numpy as np
import pytest

from jaxcoll import run

from ._launch import launch, survivors
from .test_replica_loss import KILL_STEP, STEPS, _oracle

JOB = ["--recoverable", "--nprocs", "2", "--devices-per-proc", "4", "--collective-timeout", "5"]


def _expected(path) -> tuple[dict, list[float]]:
    with np.load(path) as data:
        init = {k[5:]: data[k] for k in data.files if k.startswith("init/")}
        batches = [
            {name: data[f"batch/{i}/{name}"] for name in ("x", "y", "id")} for i in range(STEPS)
        ]
    return _oracle(init, batches)


def _final(path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k[6:]: data[k] for k in data.files if k.startswith("final/")}


@pytest.mark.timeout(120)
def test_the_job_goes_on_without_a_dead_process_and_ends_well(tmp_path):
    args = [str(tmp_path), str(KILL_STEP), str(STEPS), "1", "2", "4"]
    job = launch(JOB, "run_recoverable.py", args, timeout=100)
    assert job.returncode == 0, job.stderr[-3000:]
    assert re.search(
        r"jaxcoll-run: process 1 \(pid \d+\) was killed by SIGKILL; the job goes on without it",
        job.stderr,
    ), job.stderr[-3000:]
    assert "jaxcoll-run: done; process(es) [1] were lost on the way" in job.stderr
    assert "replacement" not in job.stderr  # no --replace
    events = json.loads((tmp_path / "p0.json").read_text())
    assert [s[0] for s in events["steps"]] == list(range(STEPS)), events["steps"]
    assert [s[4] for s in events["steps"]] == [2] * KILL_STEP + [1] * (STEPS - KILL_STEP)
    expect, losses = _expected(tmp_path / "p0.npz")
    np.testing.assert_allclose([s[2] for s in events["steps"]], losses, rtol=1e-5, atol=1e-6)
    for name, value in _final(tmp_path / "p0.npz").items():
        np.testing.assert_allclose(value, expect[name], rtol=0, atol=1e-6, err_msg=name)
    assert not (tmp_path / "p1.npz").exists()
    assert survivors(job.token) == []


@pytest.mark.timeout(150)
def test_replace_starts_one_replacement_that_joins(tmp_path):
    args = [str(tmp_path), str(KILL_STEP), str(STEPS), "1", "2", "4", "rejoin"]
    job = launch([*JOB, "--replace"], "run_recoverable.py", args, timeout=130)
    assert job.returncode == 0, job.stderr[-3000:]
    # The replacement waits the collective timeout plus twice the heartbeat (3 s) timeout.
    assert "starting a replacement for process 1 in 11 s (--replace)" in job.stderr
    assert re.search(
        r"started a replacement for process 1 \(pid \d+, JAXCOLL_REPLACEMENT=1", job.stderr
    ), job.stderr[-3000:]
    first = json.loads((tmp_path / "p0.json").read_text())
    back = json.loads((tmp_path / "p1r.json").read_text())
    joined = back["joined_at"][0]
    assert KILL_STEP < joined < STEPS, back["joined_at"]
    replicas = [2] * KILL_STEP + [1] * (joined - KILL_STEP) + [2] * (STEPS - joined)
    assert [s[4] for s in first["steps"]] == replicas, first["steps"]
    assert [s[0] for s in back["steps"]] == list(range(joined, STEPS)), back["steps"]
    expect, losses = _expected(tmp_path / "p0.npz")
    np.testing.assert_allclose([s[2] for s in back["steps"]], losses[joined:], rtol=1e-5)
    for name in ("p0", "p1r"):
        for key, value in _final(tmp_path / f"{name}.npz").items():
            np.testing.assert_allclose(value, expect[key], rtol=0, atol=1e-6, err_msg=name)
    assert survivors(job.token) == []


@pytest.mark.parametrize(
    "args,message",
    [
        (["--recoverable", "--max-restarts", "1"], "--recoverable with --max-restarts=1"),
        (["--recoverable", "--nprocs", "1:2"], "--recoverable with --nprocs=1:2 (elastic"),
        (["--replace"], "--replace needs --recoverable"),
        (["--collective-timeout", "5"], "--collective-timeout needs --recoverable"),
        (["--recoverable", "--collective-timeout", "0"], "--collective-timeout=0.0 must be"),
    ],
)
def test_the_launcher_refuses_what_does_not_combine(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        run._parse([*args, "-m", "x"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_recoverable_sets_the_job_up_for_a_survivor(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=999")
    monkeypatch.setenv("JAXCOLL_REPLACEMENT", "1")  # never inherited: only --replace sets it
    a = run._parse(["--recoverable", "--collective-timeout", "7", "--nprocs", "2", "-m", "x"])
    env = run._child_env(a, "127.0.0.1:1", "127.0.0.1:1", 1, 0)
    flags = env["XLA_FLAGS"].split()
    assert [f for f in flags if "collective_timeout_seconds" in f] == [
        "--xla_cpu_collective_timeout_seconds=7"
    ]
    assert env["JAXCOLL_RECOVERABLE"] == "1" and env["JAXCOLL_HEARTBEAT_TIMEOUT"] == "3"
    assert "JAXCOLL_REPLACEMENT" not in env
    plain = run._child_env(run._parse(["-m", "x"]), "127.0.0.1:1", "127.0.0.1:1", 0, 0)
    assert "JAXCOLL_RECOVERABLE" not in plain and plain["JAXCOLL_HEARTBEAT_TIMEOUT"] == "20"


def test_pausing_the_watchdog_turns_it_off_and_back(monkeypatch):
    import jax.numpy as jnp

    from jaxcoll import _watch
    from jaxcoll._watch import process, watchdog

    watched = process.Settings(on=True, watching=True, timeout=30.0, first_timeout=600.0)
    monkeypatch.setattr(process, "settings", dataclasses.replace(watched, configured=True))
    monkeypatch.setattr(watchdog, "_pending", collections.deque())
    before = process.settings
    with _watch.paused():
        assert not process.settings.on and not process.settings.watching
        watchdog.register(jnp.ones(2), "paused call")  # neither watched nor recorded
        assert len(watchdog._pending) == 0
    assert process.settings == before
    watchdog.register(jnp.ones(2), "watched call")
    assert len(watchdog._pending) == 1
    with pytest.raises(TypeError, match=r"resume: before must be the Settings that pause"):
        _watch.resume(None)


@pytest.mark.timeout(90)
def test_process_0_failing_still_ends_the_job(tmp_path):
    # Process 1 raises (tests/multihost/workers/faults.py, no Survivor): process 0 then fails
    # too (its all-reduce's connection closed, or jaxcoll's report of process 1's failure).
    # Process 1 is lost; process 0's exit ends the job with its code and its last line.
    job = launch(
        ["--recoverable", "--nprocs", "2", "--devices-per-proc", "2", "--grace", "3"],
        "faults.py",
        [str(tmp_path), "raise"],
        timeout=80,
    )
    assert job.returncode == 1, job.stderr[-3000:]
    assert re.search(
        r"jaxcoll-run: process 1 \(pid \d+\) exited with code 1: RuntimeError: worker 1 failed "
        r"on purpose at step 5; the job goes on without it",
        job.stderr,
    ), job.stderr[-3000:]
    assert re.search(
        r"jaxcoll-run: failed: process 0 exited with code 1: .+ \(it hosts the coordination "
        r"service\)\.",
        job.stderr,
    ), job.stderr[-3000:]
    assert survivors(job.token) == []


def test_the_launchers_heartbeat_defaults_are_init_s():
    # The launcher imports no JAX, so it states jaxcoll.init's defaults again; they must agree.
    from jaxcoll import _init, run

    assert run.HEARTBEAT_TIMEOUT == _init.HEARTBEAT_TIMEOUT
    assert run.RECOVERABLE_HEARTBEAT_TIMEOUT == _init.RECOVERABLE_HEARTBEAT_TIMEOUT
