"""Faults: the launcher fails fast, names the failed process and leaves no process behind.

Each job is 2 processes x 2 devices on 127.0.0.1 (tests/multihost/workers/faults.py). The bound
is 60 s, well under JAX's own 100 s heartbeat and 300 s init timeouts.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from ._launch import finish, launch, start, survivors

BOUND_S = 60
JOB = ["--nprocs", "2", "--devices-per-proc", "2", "--grace", "3"]


def _wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.1)


@pytest.mark.timeout(90)
def test_worker_that_raises_fails_the_job(tmp_path):
    job = launch(JOB, "faults.py", [str(tmp_path), "raise"], timeout=BOUND_S + 20)
    assert job.returncode == 1
    assert job.seconds < BOUND_S
    assert "[1] RuntimeError: worker 1 failed on purpose at step 5" in job.stderr
    # Process 1 raises; process 0, in an all-reduce with it, then stops too (it learns of the
    # failure, or gloo's connection breaks): whichever exit reaches the launcher first, the
    # cause named is process 1's, and JAX aborts neither.
    assert re.search(r"jaxcoll-run: process 1 \(pid \d+\) exited with code 1 first", job.stderr), (
        job.stderr[-3000:]
    )
    assert (
        "failed: process 1 exited with code 1: RuntimeError: worker 1 failed on purpose "
        "at step 5." in job.stderr
    ), job.stderr[-3000:]
    assert not re.search(r"^\[\d\] F\d{4} |Check failure|was killed by", job.stderr, re.M), (
        job.stderr[-3000:]
    )
    assert survivors(job.token) == []


def _start_looping(tmp_path, ready_within: float):
    """Start the 2-process job whose workers loop on all-reduces; return once both loop."""
    t0 = time.monotonic()
    popen, token = start(JOB, "faults.py", [str(tmp_path), "loop"])
    for k in (0, 1):
        _wait_for(str(tmp_path / f"loop{k}"), ready_within)
    return t0, popen, token


@pytest.mark.timeout(90)
def test_worker_killed_inside_a_collective_fails_the_job(tmp_path):
    t0, popen, token = _start_looping(tmp_path, ready_within=60)
    victim = int((tmp_path / "pid1").read_text())
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)  # process 0 is looping on all-reduces with it
    job = finish(popen, token, t0, timeout=BOUND_S + 20)
    assert job.returncode == 128 + signal.SIGKILL
    assert time.monotonic() - killed_at < BOUND_S
    assert f"process 1 (pid {victim}) was killed by SIGKILL first" in job.stderr
    assert survivors(token) == []


@pytest.mark.timeout(90)
def test_worker_that_never_starts_fails_the_job_at_the_init_timeout(tmp_path):
    # Process 1 sleeps instead of calling init; process 0 waits in init for --init-timeout.
    job = launch(
        [*JOB, "--init-timeout", "10"], "faults.py", [str(tmp_path), "hang"], timeout=BOUND_S + 20
    )
    assert job.returncode == 1
    assert job.seconds < BOUND_S
    assert "[0] init: process 0 of 2 could not join the job at 127.0.0.1:" in job.stderr
    assert "initialization_timeout=10s" in job.stderr
    assert "failed: process 0 exited with code 1" in job.stderr
    assert survivors(job.token) == []
    assert (tmp_path / "pid1").exists()  # process 1 did start, and was stopped


@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_is_forwarded_and_nothing_is_left(tmp_path):
    t0, popen, token = _start_looping(tmp_path, ready_within=40)
    popen.send_signal(signal.SIGTERM)
    job = finish(popen, token, t0, timeout=30)
    assert job.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM; forwarding it to 2 process(es)" in job.stderr
    assert survivors(token) == []


def test_launcher_rejects_bad_arguments(tmp_path):
    cases = [
        (["--nprocs", "0"], "--nprocs=0 must be at least 1"),
        (["--nprocs", "3:2"], "--nprocs=3:2 must be at least 1, with MIN <= MAX."),
        (["--nprocs", "two"], "--nprocs=two is not a count (4) or a range MIN:MAX (2:4)."),
        (
            ["--nprocs", "1:2", "--nnodes", "2", "--coordinator", "h:1"],
            "--nprocs=1:2 (elastic) works on one node",
        ),
        (["--timeout", "10", "--first-timeout", "5"], "--first-timeout=5 is shorter than"),
        (["--nnodes", "2"], "--nnodes=2 needs --coordinator HOST:PORT"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1"],
            "--node-rank=2 is out of range for --nnodes=2",
        ),
        (["--coordinator", "nohost"], "--coordinator='nohost' is not HOST:PORT"),
    ]
    for args, message in cases:
        job = launch(args, "faults.py", [str(tmp_path), "raise"], timeout=30)
        assert job.returncode == 2, args
        assert message in job.stderr, job.stderr


@pytest.mark.timeout(60)
def test_a_taken_coordinator_port_is_named_before_jax_starts(tmp_path):
    # Another program listens on the coordinator's port. JAX's service does not say so (the
    # process can crash with SIGSEGV, or wait for the init timeout); init names the port.
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXCOLL_", "JAX_"))}
        env["JAX_PLATFORMS"] = "cpu"
        code = f"import jaxcoll; jaxcoll.init('127.0.0.1:{port}', 2, 0)"
        script = tmp_path / "job.py"
        script.write_text("import jaxcoll\njaxcoll.init()\n")
        for cmd in (
            [sys.executable, "-c", code],
            [
                sys.executable,
                "-m",
                "jaxcoll.run",
                "--nprocs",
                "2",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--init-timeout",
                "20",
                str(script),
            ],
        ):
            # Not timed (the machine may be loaded): the message is init's own, raised before
            # JAX starts its service, and the exit code is 1, not a signal.
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=50)
            assert proc.returncode == 1, (cmd, proc.returncode, proc.stderr[-2000:])
            assert f"port {port} is already in use by another program" in proc.stderr, proc.stderr[
                -2000:
            ]


def test_the_launcher_drops_gloos_connection_reports_only():
    from jaxcoll.run._output import gloo_report

    for line in (
        "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected "
        "peer ranks is : 7\n",
        # two threads' reports interleaved mid-line, as seen in a 2 x 4 job
        "[Gloo] Rank 3[Gloo] Rank 2 is connected to  is connected to 77 peer ranks. "
        "Expected number of connected peer ranks is : 7\n",
        " peer ranks. Expected number of connected peer ranks is : 7\n",
        # the rank number of the first fragment written after the second's
        "[Gloo] Rank [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of "
        "connected peer ranks is : 3\n",
    ):
        assert gloo_report(line), line
    for line in (
        "result [36. 36.]\n",
        "RuntimeError: Gloo connect timed out\n",
        "[Gloo] Rank 3 is connected to 5 peer ranks; giving up\n",
        "\n",
    ):
        assert not gloo_report(line), line
