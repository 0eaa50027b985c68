"""No job hangs: every way two processes can disagree ends the job fast, with one clear line.

Each job is 2 processes x 2 devices on 127.0.0.1 (tests/multihost/workers/hangs.py) under
``jaxcoll-run --timeout 10``: the watchdog's cases end in about 15 s (start-up, the 10 s
timeout, teardown), mismatch detection's (``--debug detail``) in under 10 s, SIGTERM within a
second. Each test checks the exit code, the line that names the process and the cause (and
that the launcher's summary quotes it, not a C++ stack dump), the time, and that no process
is left. docs/failing-fast.md lists the measured times.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import jaxcoll

from ._launch import ROOT, TOKEN_VAR, WORKERS, finish, launch, start, survivors
from .test_faults import _wait_for

TIMEOUT_S = 10
WATCHDOG_BOUND_S = 30  # the goal with a 10 s timeout
JOB = [
    "--nprocs",
    "2",
    "--devices-per-proc",
    "2",
    "--grace",
    "3",
    "--timeout",
    str(TIMEOUT_S),
    "--first-timeout",
    str(TIMEOUT_S),
]
DETAIL = [*JOB, "--debug", "detail"]
WORKER = os.path.join(WORKERS, "hangs.py")


def _line(text: str, after: str | None = None) -> str:
    """``tests/multihost/workers/hangs.py:N``: where ``text`` first is in the worker (after
    the line holding ``after``): the call site the flight record must name."""
    with open(WORKER) as fh:
        for n, line in enumerate(fh, 1):
            if after is not None:
                after = None if after in line else after
            elif text in line:
                return f"{os.path.relpath(WORKER, ROOT)}:{n}"
    raise AssertionError(f"{text!r} is not in {WORKER}")


def _first_finding(job) -> str:
    """The flight-record analysis's first finding, as ``jaxcoll-run`` printed it."""
    m = re.search(r"^jaxcoll-run:   first: (.*)$", job.stderr, re.M)
    assert m, job.stderr[-3000:]
    return m.group(1)


def _summary(job) -> str:
    """The launcher's last line: ``jaxcoll-run: failed: process K ...: <cause>``."""
    lines = [ln for ln in job.stderr.splitlines() if ln.startswith("jaxcoll-run: failed:")]
    assert lines, job.stderr[-3000:]
    return lines[-1]


def _first_named(job) -> int:
    m = re.search(r"jaxcoll-run: process (\d) \(pid \d+\) \S.* first", job.stderr)
    assert m, job.stderr[-3000:]
    return int(m.group(1))


def _no_abort(job) -> None:
    """No process was aborted: no C++ fatal log line, no check failure, no signal."""
    assert not re.search(
        r"^\[\d\] F\d{4} |Check failure|SIGABRT|was killed by", job.stderr, re.M
    ), job.stderr[-3000:]


def _check_watchdog(job, what: str) -> int:
    """A watchdog end: exit 1, the summary quotes the jaxcoll line; returns the process."""
    assert job.returncode == 1, job.stderr[-3000:]
    assert job.seconds < WATCHDOG_BOUND_S, job.seconds
    summary = _summary(job)
    first = _first_named(job)
    assert (
        f"failed: process {first} exited with code 1: jaxcoll: process {first} of 2 "
        f"timed out after" in summary
    ), summary
    assert f"(timeout {TIMEOUT_S}s) waiting for {what}" in summary, summary
    waited = float(re.search(r"timed out after ([\d.]+)s", summary).group(1))
    assert TIMEOUT_S <= waited < TIMEOUT_S + 2, summary
    _no_abort(job)
    assert survivors(job.token) == []
    return first


def _check_mismatch(job, apis: tuple[str, str], message: str) -> None:
    """Detection: every process raises, naming its own call and every process's fields."""
    # No wall-time bound (4-8 s on a quiet machine, docs/failing-fast.md; more under load):
    # each process's RuntimeError below shows detection ended the job, before any collective
    # could hang.
    assert job.returncode == 1, job.stderr[-3000:]
    for k in (0, 1):
        line = f"[{k}] RuntimeError: {apis[k]}: processes disagree on the collective #1: {message}"
        assert line in job.stderr, job.stderr[-3000:]
    first = _first_named(job)
    assert (
        f"exited with code 1: RuntimeError: {apis[first]}: processes disagree on the "
        f"collective #1: {message}" in _summary(job)
    )
    assert "result" not in job.stdout  # nobody went on with a wrong answer
    _no_abort(job)
    assert survivors(job.token) == []


@pytest.mark.timeout(60)
def test_different_collectives_end_at_the_timeout(tmp_path):
    # Process 0 all-reduces, process 1 all-gathers: gloo waits for ever; the watchdog ends it.
    trace_dir = tmp_path / "trace"
    job = launch(
        [*JOB, "--trace-dir", str(trace_dir)], "hangs.py", [str(tmp_path), "op"], timeout=60
    )
    op = ("dist.all_reduce", "dist.all_gather")[_first_named(job)]  # both time out; either
    _check_watchdog(job, f"{op}(float32[4,3]) over processes 0-1 (call #1 at hangs.py:")
    # The flight records name both sides: the call number, each op and the user's line.
    site = _line("dist.all_reduce(x) if ME == 0 else dist.all_gather(x)")
    expected = (
        f"the processes disagree at call #1 of processes 0-1: process 0 runs "
        f"dist.all_reduce(float32[4,3]) op=SUM at {site}; process 1 runs "
        f"dist.all_gather(float32[4,3]) dim=0 tiled=False at {site}."
    )
    assert _first_finding(job) == expected, job.stderr[-3000:]
    # The same analysis offline, from the records the job left in --trace-dir.
    offline = subprocess.run(
        [sys.executable, "-m", "jaxcoll.trace", str(trace_dir / "restart0")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert offline.returncode == 1, offline.stderr
    assert f"  first: {expected}" in offline.stdout.splitlines(), offline.stdout


@pytest.mark.timeout(60)
def test_a_program_that_completed_before_gets_the_short_timeout(tmp_path):
    # --timeout 3, --first-timeout 20: both processes all-reduce once; then process 0
    # all-reduces again while process 1 sleeps. The second call of a program that has
    # completed ends at 3 s, not 20.
    args = [*JOB[:6], "--timeout", "3", "--first-timeout", "20"]
    job = launch(args, "hangs.py", [str(tmp_path), "second"], timeout=60)
    assert job.returncode == 1, job.stderr[-3000:]
    site = _line("y = dist.all_reduce(x)", after='MODE == "second"')
    assert re.search(
        r"failed: process 0 exited with code 1: jaxcoll: process 0 of 2 timed out after "
        r"3\.\ds \(timeout 3s\) waiting for dist.all_reduce\(float32\[4,3\]\) over processes "
        r"0-1 \(call #2 at hangs.py:\d+\)",
        _summary(job),
    ), job.stderr[-3000:]
    assert _first_finding(job).startswith(
        f"call #2 of processes 0-1: process(es) 0 issued it (dist.all_reduce(float32[4,3]) "
        f"op=SUM at {site}); process 1 never issued it (its last call there was #1, at "
        f"{_line('time.sleep(30)')} in <module> when it wrote: jaxcoll: process 1 of 2 stops: "
        f"process 0 failed (jaxcoll: process 0 of 2 timed out after 3."
    ), job.stderr[-3000:]
    _no_abort(job)
    assert survivors(job.token) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["src", "dtype", "shape"])
def test_mismatches_without_detection_are_named_by_the_flight_records(tmp_path, mode):
    # Detection off: a broadcast from two sources hangs until the watchdog fires, int32
    # against float32 "succeeds" with garbage, different shapes end with one process gone.
    # Whatever the ending, the analysis of the processes' records names the call number,
    # both programs and the line.
    job = launch(JOB, "hangs.py", [str(tmp_path), mode], timeout=60)
    assert job.returncode == (0 if mode == "dtype" else 1), job.stderr[-3000:]
    call = {
        "src": ("dist.broadcast(x, src=0 if ME == 0 else 3)", "dist.broadcast", "src=0", "src=3"),
        "dtype": ("rows(3, np.float32 if ME == 0", "dist.all_reduce", "op=SUM", "op=SUM"),
        "shape": ("rows(3 if ME == 0 else 5)", "dist.all_reduce", "op=SUM", "op=SUM"),
    }[mode]
    args = {"dtype": ("float32[4,3]", "int32[4,3]"), "shape": ("float32[4,3]", "float32[4,5]")}
    a0, a1 = args.get(mode, ("float32[4,3]", "float32[4,3]"))
    site = _line(call[0])
    expected = (
        f"the processes disagree at call #1 of processes 0-1: process 0 runs "
        f"{call[1]}({a0}) {call[2]} at {site}; process 1 runs {call[1]}({a1}) {call[3]} at "
        f"{site}."
    )
    assert _first_finding(job) == expected, job.stderr[-3000:]
    if mode == "dtype":  # the job "succeeded": the launcher warns instead of staying silent
        assert "jaxcoll-run: warning: the processes' flight records disagree" in job.stderr
    _no_abort(job)
    assert survivors(job.token) == []


@pytest.mark.timeout(60)
def test_different_collectives_are_named_by_detection(tmp_path):
    job = launch(DETAIL, "hangs.py", [str(tmp_path), "op"], timeout=60)
    _check_mismatch(
        job,
        ("dist.all_reduce", "dist.all_gather"),
        "process 0: all_reduce float32[4,3] op=SUM; process 1: all_gather "
        "float32[4,3] dim=0 tiled=False",
    )


@pytest.mark.timeout(60)
def test_different_broadcast_sources_are_named_by_detection(tmp_path):
    job = launch(DETAIL, "hangs.py", [str(tmp_path), "src"], timeout=60)
    _check_mismatch(
        job,
        ("dist.broadcast",) * 2,
        "process 0: broadcast float32[4,3] src=0; process 1: broadcast float32[4,3] src=3",
    )


@pytest.mark.timeout(60)
def test_float32_against_int32_raises_instead_of_a_wrong_answer(tmp_path):
    job = launch(DETAIL, "hangs.py", [str(tmp_path), "dtype"], timeout=60)
    _check_mismatch(
        job,
        ("dist.all_reduce",) * 2,
        "process 0: all_reduce float32[4,3]; process 1: all_reduce int32[4,3]",
    )


@pytest.mark.timeout(60)
def test_different_shapes_raise_instead_of_an_xla_abort(tmp_path):
    job = launch(DETAIL, "hangs.py", [str(tmp_path), "shape"], timeout=60)
    _check_mismatch(
        job,
        ("dist.all_reduce",) * 2,
        "process 0: all_reduce float32[4,3]; process 1: all_reduce float32[4,5]",
    )
    assert "Check failure" not in job.stderr and "SIGABRT" not in job.stderr


@pytest.mark.timeout(60)
def test_peer_spinning_outside_any_collective_ends_at_the_timeout(tmp_path):
    # Process 0 runs its own jaxcoll.watch-ed shard_map; process 1 spins in Python (alive,
    # heartbeating): the watchdog names process 0's program, the launcher stops process 1.
    job = launch(JOB, "hangs.py", [str(tmp_path), "spin"], timeout=60)
    assert _check_watchdog(job, "user step(float32[4,3])") == 0
    assert "the other processes have not joined it" in _summary(job)
    # The records say where process 1 was instead: its spinning line, not a collective.
    assert _first_finding(job).startswith(
        f"call #1 of processes 0-1: process(es) 0 issued it (user step(float32[4,3]) at "
        f"{_line('y = step(x)')}); process 1 never issued it (it issued none there, at "
        f"{_line('while True:  # alive')} in <module> when it wrote: jaxcoll: process 1 of 2 "
        f"stops: process 0 failed"
    ), job.stderr[-3000:]
    # Process 1 learns of process 0's failure and leaves by itself, naming it; process 0, the
    # coordination service's host, leaves after it, so JAX aborts neither.
    assert (
        "then process 1 exited with code 1: jaxcoll: process 1 of 2 stops: process 0 "
        "failed (jaxcoll: process 0 of 2 timed out after" in job.stderr
    ), job.stderr[-3000:]
    assert "SIGABRT" not in job.stderr and "F1" not in job.stderr


@pytest.mark.timeout(60)
def test_peer_that_exits_early_is_named(tmp_path):
    # Process 1 exits 0 while process 0 waits in an all-reduce with it: its exit marker lets
    # process 0 give up within seconds, not at JAX's 60 s shutdown barrier with SIGABRT.
    job = launch(JOB, "hangs.py", [str(tmp_path), "exit"], timeout=60)
    assert job.returncode == 1, job.stderr[-3000:]
    assert job.seconds < WATCHDOG_BOUND_S
    summary = _summary(job)
    expected = (
        r"failed: process 0 exited with code 1: jaxcoll: process 0 of 2 gave up after "
        r"[\d.]+s waiting for dist.all_reduce\(float32\[4,3\]\) over processes 0-1 \(call "
        r"#1 at hangs.py:\d+\): process\(es\) 1 exited while this one waits for it"
    )
    assert re.search(expected, summary), summary
    site = _line("y = dist.all_reduce(x)", after='MODE == "exit"')
    assert _first_finding(job) == (
        f"call #1 of processes 0-1: process(es) 0 issued it (dist.all_reduce(float32[4,3]) "
        f"op=SUM at {site}); process 1 never issued it (it issued none there; it "
        f"exited)."
    ), job.stderr[-3000:]
    # Process 1, already past its exit and waiting at JAX's shutdown barrier, is let through
    # it by process 0 (the coordination service's host) before process 0 leaves: it ends
    # with its own code 0, and JAX aborts no one.
    assert "then process 1" not in job.stderr, job.stderr[-3000:]
    _no_abort(job)
    assert survivors(job.token) == []


@pytest.mark.timeout(60)
def test_process_0_that_fails_on_purpose_is_named_first(tmp_path):
    # Process 0 raises SystemExit("...") while process 1 waits in an all-reduce with it:
    # process 1 gives up on seeing process 0 exit and lets it through JAX's shutdown barrier;
    # the launcher names process 0 and its message (a follow-on never counts as the cause).
    job = launch(JOB, "hangs.py", [str(tmp_path), "fail0"], timeout=60)
    assert job.returncode == 1, job.stderr[-3000:]
    assert job.seconds < WATCHDOG_BOUND_S
    assert _first_named(job) == 0, job.stderr[-3000:]
    assert _summary(job) == (
        "jaxcoll-run: failed: process 0 exited with code 1: hangs.py: "
        "process 0 gives up on purpose."
    ), job.stderr[-3000:]
    assert re.search(
        r"then process 1 exited with code 1: jaxcoll: process 1 of 2 gave up "
        r"after [\d.]+s waiting for dist.all_reduce",
        job.stderr,
    ), job.stderr[-3000:]
    site = _line("y = dist.all_reduce(x)", after='MODE == "fail0"')
    assert _first_finding(job) == (
        f"call #1 of processes 0-1: process(es) 1 issued it (dist.all_reduce(float32[4,3]) "
        f"op=SUM at {site}); process 0 never issued it (it issued none there; it exited)."
    ), job.stderr[-3000:]
    _no_abort(job)
    assert survivors(job.token) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["apart", "apart1"])
def test_processes_that_finish_seconds_apart_end_cleanly(tmp_path, mode):
    # The first to finish waits at JAX's shutdown barrier for the other, 3 s later; whichever
    # hosts the coordination service, both end with code 0 and nothing is aborted.
    job = launch(JOB, "hangs.py", [str(tmp_path), mode], timeout=60)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("result") == 2, job.stdout
    assert "Polled an error" not in job.stderr and "Traceback" not in job.stderr, job.stderr
    assert "Gloo" not in job.stdout + job.stderr  # its connection reports are dropped
    _no_abort(job)
    assert survivors(job.token) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", ["0", "inf"])
def test_a_clean_job_with_the_watchdog_off_raises_no_alarm(tmp_path, timeout):
    # One all_reduce, its result printed, a normal exit at once: the flight records must say
    # the call completed on both processes (it did), not that it stalled on both.
    job = launch([*JOB[:4], "--timeout", timeout], "hangs.py", [str(tmp_path), "once"], timeout=60)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("result [10. 10. 10.]") == 2, job.stdout
    assert "flight records" not in job.stderr, job.stderr[-3000:]
    _no_abort(job)
    assert survivors(job.token) == []


@pytest.mark.timeout(60)
def test_sigterm_stops_workers_blocked_in_a_collective_at_once(tmp_path):
    # Process 0 waits inside an all-reduce (its main thread in C++), process 1 sleeps. JAX's
    # preemption notifier would swallow SIGTERM; jaxcoll's handler ends both inside the
    # launcher's 10 s grace (no SIGKILL).
    t0 = time.monotonic()
    popen, token = start(
        [*JOB[:4], "--grace", "10", "--timeout", "0"], "hangs.py", [str(tmp_path), "block"]
    )
    for k in (0, 1):
        _wait_for(str(tmp_path / f"loop{k}"), 60)
    time.sleep(1.0)  # process 0 is now inside the all-reduce
    sent = time.monotonic()
    popen.send_signal(signal.SIGTERM)
    job = finish(popen, token, t0, timeout=30)
    assert job.returncode == 128 + signal.SIGTERM
    # Ended by their own handlers (the lines below), before the launcher's 10 s grace ran
    # out and it would have sent SIGKILL; within a second on a quiet machine.
    assert time.monotonic() - sent < 10
    for k in (0, 1):
        assert (
            f"[{k}] jaxcoll: process {k} received SIGTERM; exiting with code 143." in job.stderr
        ), job.stderr[-3000:]
    assert not re.search(r"^\[\d\] F\d{4} |Check failure", job.stderr, re.M), job.stderr
    # Both wrote their records on SIGTERM: process 1 was asleep, not in the collective.
    site = _line("y = dist.all_reduce(x)", after='MODE == "block"')
    assert _first_finding(job) == (
        f"call #1 of processes 0-1: process(es) 0 issued it (dist.all_reduce(float32[4,3]) "
        f"op=SUM at {site}); process 1 "
        f"never issued it (it issued none there, at {_line('time.sleep(3600)')} in <module> "
        f"when it wrote: jaxcoll: process 1 received SIGTERM; exiting with code 143.)."
    ), job.stderr[-3000:]
    assert survivors(token) == []


@pytest.mark.timeout(60)
def test_sigterm_to_one_process_stops_every_loop_after_the_same_step(tmp_path):
    # Both loops run inside jaxcoll.handle_preemption (with detection on: equal programs pass).
    t0 = time.monotonic()
    trace_dir = tmp_path / "trace"
    popen, token = start(
        [*DETAIL, "--trace-dir", str(trace_dir)], "hangs.py", [str(tmp_path), "preempt"]
    )
    for k in (0, 1):
        _wait_for(str(tmp_path / f"loop{k}"), 60)
    # SIGUSR1: process 0 writes its flight record and goes on looping.
    os.kill(int((tmp_path / "pid0").read_text()), signal.SIGUSR1)
    record = trace_dir / "restart0" / "process0.json"
    _wait_for(str(record), 30)
    data = json.loads(record.read_text())
    assert data["reason"] == "SIGUSR1" and data["process"] == 0
    ops = {c["op"] for c in data["calls"]}
    assert ops == {"dist.all_reduce"} and len(data["calls"]) >= 3, data["calls"][-3:]
    assert [c["group_seq"] for c in data["calls"]] == list(range(1, len(data["calls"]) + 1))
    sent = time.monotonic()
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGTERM)
    job = finish(popen, token, t0, timeout=30)
    assert job.returncode == 128 + signal.SIGTERM, job.stderr[-3000:]
    assert time.monotonic() - sent < 5
    assert "[1] jaxcoll: process 1 received SIGTERM; the training loop will stop" in job.stderr
    steps = {
        int(k): int(s)
        for k, s in re.findall(r"\[(\d)\] process \d stops after step (\d+)", job.stdout)
    }
    assert sorted(steps) == [0, 1] and steps[0] == steps[1], job.stdout[-2000:]
    assert survivors(token) == []


@pytest.mark.timeout(60)
def test_torchrun_variables_on_loopback_bind_the_coordinator_to_loopback(tmp_path):
    # Started with MASTER_ADDR=127.0.0.1 (no jaxcoll-run): the coordinator must not listen on
    # every interface, as JAX's default [::]:port does.
    from jaxcoll.run import free_port

    port = free_port()
    token = f"bind-{port}"
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXCOLL_", "JAX_"))}
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE="2",
            RANK=str(rank),
            JAX_PLATFORMS="cpu",
            JAX_NUM_CPU_DEVICES="2",
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            **{TOKEN_VAR: token},
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(WORKERS, "hangs.py"), str(tmp_path), "bind"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=50) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "result [10. 10. 10.]" in out
    listeners = (tmp_path / "listen").read_text().split()
    assert listeners, "nothing listened on the coordinator port"
    loopback = {
        "0100007F",
        "00000000000000000000000001000000",  # 127.0.0.1, ::1
        "0000000000000000FFFF00000100007F",
    }  # ::ffff:127.0.0.1
    assert set(listeners) <= loopback, listeners
    assert survivors(token) == []


@pytest.mark.parametrize(
    ("kwargs", "env", "match"),
    [
        (
            {},
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "1",
                "WORLD_SIZE": "2",
                "RANK": "0",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "abc",
            },
            r"init: environment variable LOCAL_WORLD_SIZE='abc' is not an integer",
        ),
        (
            {"num_processes": 2, "process_id": 0},
            {},
            r"init: got num_processes=2, process_id=0 but no coordinator_address\. Pass all three",
        ),
        ({"timeout": -1}, {}, r"init: timeout=-1 must be 0 \(off\) or a positive number"),
        ({}, {"JAXCOLL_TIMEOUT": "ten"}, r"init: JAXCOLL_TIMEOUT='ten' is not a number"),
        ({}, {"JAXCOLL_DEBUG": "verbose"}, r"init: JAXCOLL_DEBUG='verbose' is not 'detail'"),
    ],
)
def test_init_messages_name_the_variable_and_its_value(monkeypatch, kwargs, env, match):
    for var in (
        "JAXCOLL_COORDINATOR_ADDRESS",
        "JAXCOLL_NUM_PROCESSES",
        "JAXCOLL_PROCESS_ID",
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "JAXCOLL_TIMEOUT",
        "JAXCOLL_DEBUG",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
    ):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(ValueError, match=match):
            jaxcoll.init(**kwargs)
    finally:
        monkeypatch.delenv("JAXCOLL_TIMEOUT", raising=False)
        monkeypatch.delenv("JAXCOLL_DEBUG", raising=False)
        jaxcoll._watch.configure()  # back to off for the other tests of this process
