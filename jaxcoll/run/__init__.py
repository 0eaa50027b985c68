"""``jaxcoll-run``: start a multi-process JAX job on this host, the way torchrun does.

Usage::

    jaxcoll-run --nprocs 2 --devices-per-proc 4 train.py --lr 0.1
    python -m jaxcoll.run --nprocs 2 -m mypackage.train          # a module instead of a file
    jaxcoll-run --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29500 --nprocs 4 train.py

Each process gets ``JAXCOLL_COORDINATOR_ADDRESS``, ``JAXCOLL_NUM_PROCESSES``,
``JAXCOLL_PROCESS_ID`` (global index ``node_rank * nprocs + local_rank``),
``JAXCOLL_LOCAL_RANK``, ``JAXCOLL_LOCAL_WORLD_SIZE``, ``JAXCOLL_NODE_RANK``,
``JAXCOLL_RESTART_COUNT`` and the timeouts, which :func:`jaxcoll.init` reads. With
``--devices-per-proc D`` each process simulates ``D`` CPU devices (``XLA_FLAGS``) and is
given local accelerators ``D * local_rank .. D * local_rank + D - 1``.

``--timeout S`` (``JAXCOLL_TIMEOUT``) and ``--first-timeout S`` (``JAXCOLL_FIRST_TIMEOUT``)
are the collective timeouts of jaxcoll's watchdog, after and before a program's first
completion, and ``--debug detail`` (``JAXCOLL_DEBUG``) turns on mismatch detection (see
:func:`jaxcoll.init`).

Each process writes its flight record (:func:`jaxcoll.dump_trace`) into ``--trace-dir``
(``JAXCOLL_TRACE_DIR``; default a temporary directory, removed after a clean run) when it
ends early, and at its normal exit. When the job fails, the launcher prints what the records
say (:mod:`jaxcoll.trace`): the first call at which the processes disagree, a call some
never issued and where they were instead, a call that stalled everywhere, or one the others
wait in while a process wrote no record (killed); after a clean run it warns when they
disagree (a wrong answer that hung nothing).

Every output line is prefixed with ``[k]``, the process index; gloo's per-rank connection
reports are dropped. If a process exits non-zero or is killed, the launcher gives the others
up to 10 s to end by themselves (a jaxcoll process learns of a peer's failure within a second
or two and exits with its own line; the process hosting JAX's coordination service leaves
last, so JAX aborts none), then sends SIGTERM to every process group still running, SIGKILL
after ``--grace`` seconds, and exits non-zero. It names the cause: the earliest failure that
is not a consequence of another (a peer's "stops: process K failed", a closed gloo
connection), with the last ``Name: message`` line that process wrote to stderr (such as the
watchdog's ``jaxcoll: process 0 of 2 timed out ...`` or ``RuntimeError: ...``; else its last
line, e.g. a ``SystemExit`` message), and exits with that process's exit code (or 128 +
signal). A process that printed jaxcoll's exit line counts as failing from that line.
jaxcoll's SIGTERM handler ends each worker within a second, even one blocked in a
collective. With ``--max-restarts K`` it restarts the whole group up to K times instead;
with ``--nprocs MIN:MAX`` a process that fails K + 1 times in a row is then left out and
the others restart on their own devices, while at least MIN are left. SIGINT and
SIGTERM sent to the launcher are forwarded to every process. Each process runs in its own
session (process group) and is killed with the launcher if the launcher itself dies, so no
process outlives it.

With ``--recoverable`` the job goes on when a process other than 0 dies
(:class:`jaxcoll.dp.Survivor`): every process gets ``JAXCOLL_RECOVERABLE=1`` and XLA:CPU's
``--xla_cpu_collective_timeout_seconds`` set to ``--collective-timeout`` (default 10 s, so a
survivor's collective with the dead process raises instead of waiting), and the heartbeat
timeout defaults to 3 s. A process other than 0 that fails is reported on stderr (its index,
exit code and last line) and left out; with ``--replace`` one replacement is started under its
id, once per id, with ``JAXCOLL_REPLACEMENT=1`` (it calls ``Survivor.join``). Process 0 hosts
JAX's coordination service: its failure still ends the job, as does a failure after it has
ended. The exit code is 0 when process 0 and every process still running exit 0 (on another
node: when at least one of its processes ran to the end and each that did exited 0).
``--recoverable`` does not combine with ``--max-restarts`` or ``--nprocs MIN:MAX`` (they
restart the group; this mode goes on without restarting).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .. import trace
from . import _recoverable
from ._group import POLL_S as _POLL_S
from ._group import _child_env as _child_env
from ._group import _Group
from ._group import free_port as free_port
from ._output import Proc, because, describe_exit

__all__ = ["main"]

# jaxcoll.init's heartbeat defaults (jaxcoll/_init.py), given here too: the launcher imports no
# JAX, and it passes the value to every process it starts (JAXCOLL_HEARTBEAT_TIMEOUT).
HEARTBEAT_TIMEOUT = 20
RECOVERABLE_HEARTBEAT_TIMEOUT = 3

_SETTLE_S = 10.0  # how long the others may take to end by themselves after a failure


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxcoll-run",
        description="Start N processes of a JAX program on this host as one jax.distributed "
        "job (the torchrun of jaxcoll).",
    )
    _add_job_options(p)
    _add_supervision_options(p)
    _add_watchdog_options(p)
    _add_recovery_options(p)
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    p.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="run the program as a module (python -m), like python -m",
    )
    p.add_argument("program", help="the script (or, with -m, the module) to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")
    return p


def _add_job_options(p: argparse.ArgumentParser) -> None:
    """The job's shape: processes, devices, nodes and where the coordinator listens."""
    p.add_argument(
        "--nprocs",
        "--nproc-per-node",
        default="1",
        dest="nprocs",
        metavar="N|MIN:MAX",
        help="processes to start on this node (default 1); MIN:MAX: start MAX, and when a "
        "process keeps failing past --max-restarts, go on without it while at least MIN "
        "are left (one node only)",
    )
    p.add_argument(
        "--devices-per-proc",
        type=int,
        default=None,
        help="devices per process: simulated CPU devices, and the local "
        "accelerator ids each process gets (default: JAX's own choice)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's coordination service (default: 127.0.0.1 and a free "
        "port; required with --nnodes > 1)",
    )
    p.add_argument(
        "--bind",
        default=None,
        metavar="HOST:PORT",
        help="where the coordination service listens (default: the coordinator "
        "address itself, so loopback for a one-node job)",
    )


def _add_supervision_options(p: argparse.ArgumentParser) -> None:
    """What the launcher does when a process fails, and how long joining may take."""
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole group up to K times after a failure (default 0)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping processes",
    )
    p.add_argument(
        "--init-timeout",
        type=int,
        default=30,
        help="seconds for every process to connect (JAXCOLL_INIT_TIMEOUT)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        help=f"seconds without heartbeat before a peer counts as dead (default "
        f"{HEARTBEAT_TIMEOUT}; {RECOVERABLE_HEARTBEAT_TIMEOUT} with --recoverable)",
    )


def _add_recovery_options(p: argparse.ArgumentParser) -> None:
    """--recoverable: the job goes on without a dead process (dp.Survivor)."""
    p.add_argument(
        "--recoverable",
        action="store_true",
        help="go on when a process other than 0 dies: report it instead of ending the job; "
        "every process gets JAXCOLL_RECOVERABLE=1 and a finite XLA collective timeout "
        "(for dp.Survivor). Process 0's death still ends the job: it hosts the "
        "coordination service. Not with --max-restarts or --nprocs MIN:MAX",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        metavar="S",
        help="with --recoverable: seconds a collective waits for a dead peer before it "
        "raises (XLA:CPU's --xla_cpu_collective_timeout_seconds in XLA_FLAGS; default "
        f"{_recoverable.DEFAULT_COLLECTIVE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="with --recoverable: start one replacement under a dead process's id (same "
        "coordinator and environment, JAXCOLL_REPLACEMENT=1), at most once per id",
    )


def _add_watchdog_options(p: argparse.ArgumentParser) -> None:
    """jaxcoll's watchdog in each process: collective timeouts, flight records, debug."""
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a collective may wait before the watchdog ends its process "
        "once its program has completed before (JAXCOLL_TIMEOUT; default 300 in a "
        "multi-process job, 0 = off)",
    )
    p.add_argument(
        "--first-timeout",
        type=float,
        default=None,
        help="the same before a program's first completion, while peers may still compile "
        "it (JAXCOLL_FIRST_TIMEOUT; default max(600, --timeout))",
    )
    p.add_argument(
        "--trace-dir",
        default=None,
        metavar="DIR",
        help="where the processes write their flight records (default: a temporary "
        "directory, removed after a clean run); analysed when the job fails",
    )
    p.add_argument(
        "--debug",
        choices=("off", "detail"),
        default=None,
        help="'detail': check at each program's first use that every process runs "
        "the same collective (JAXCOLL_DEBUG)",
    )


def _error(msg: str) -> None:
    print(f"jaxcoll-run: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _nprocs(text: str) -> tuple[int, int]:
    """``--nprocs``: ``N`` or ``MIN:MAX``, as (MIN, MAX)."""
    low, sep, high = str(text).partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        _error(f"--nprocs={text} is not a count (4) or a range MIN:MAX (2:4).")
    if lo < 1 or hi < lo:
        _error(f"--nprocs={text} must be at least 1" + (", with MIN <= MAX." if sep else "."))
    return lo, hi


def _check(a: argparse.Namespace) -> None:
    a.min_nprocs, a.nprocs = _nprocs(a.nprocs)
    if a.min_nprocs < a.nprocs and a.nnodes > 1:
        _error(
            f"--nprocs={a.min_nprocs}:{a.nprocs} (elastic) works on one node: with "
            f"--nnodes={a.nnodes} every node's launcher would shrink on its own. Across nodes, "
            f"restart the job on the nodes left (examples/slurm_elastic.sbatch)."
        )
    if a.devices_per_proc is not None and a.devices_per_proc < 1:
        _error(f"--devices-per-proc={a.devices_per_proc} must be at least 1.")
    if a.nnodes < 1:
        _error(f"--nnodes={a.nnodes} must be at least 1.")
    if not 0 <= a.node_rank < a.nnodes:
        _error(
            f"--node-rank={a.node_rank} is out of range for --nnodes={a.nnodes} "
            f"(0..{a.nnodes - 1})."
        )
    if a.nnodes > 1 and a.coordinator is None:
        _error(
            f"--nnodes={a.nnodes} needs --coordinator HOST:PORT (the address of node 0, "
            f"the same on every node)."
        )
    for flag, value in (("--coordinator", a.coordinator), ("--bind", a.bind)):
        if value is not None:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                _error(
                    f"{flag}={value!r} is not HOST:PORT with a port in 1..65535, "
                    f"e.g. 10.0.0.1:29500."
                )
    if a.max_restarts < 0:
        _error(f"--max-restarts={a.max_restarts} must be 0 or more.")
    if a.grace < 0:
        _error(f"--grace={a.grace} must be 0 or more seconds.")
    if a.timeout is not None and not a.timeout >= 0:
        _error(f"--timeout={a.timeout} must be 0 (off) or a positive number of seconds.")
    if a.first_timeout is not None and not a.first_timeout >= 0:
        _error(
            f"--first-timeout={a.first_timeout} must be 0 (off) or a positive number of seconds."
        )
    if (
        a.first_timeout is not None
        and a.timeout
        and (a.first_timeout == 0 or a.first_timeout < a.timeout)
    ):
        _error(
            f"--first-timeout={a.first_timeout:g} is shorter than --timeout={a.timeout:g}: "
            f"a program's first run waits for its peers' compiles too. Set it to at least "
            f"{a.timeout:g}, or leave it out."
        )
    _check_recovery(a)
    if a.init_timeout < 1 or a.heartbeat_timeout < 1:
        _error("--init-timeout and --heartbeat-timeout must be at least 1 second.")
    if not a.module and not os.path.exists(a.program):
        _error(f"program {a.program!r} does not exist. Pass a script path, or -m MODULE.")


def _check_recovery(a: argparse.Namespace) -> None:
    """--recoverable, --collective-timeout, --replace; the heartbeat timeout's default."""
    if not a.recoverable:
        for flag, given in (
            ("--collective-timeout", a.collective_timeout is not None),
            ("--replace", a.replace),
        ):
            if given:
                _error(f"{flag} needs --recoverable (the job going on without a dead process).")
        if a.heartbeat_timeout is None:
            a.heartbeat_timeout = HEARTBEAT_TIMEOUT
        return
    if a.max_restarts:
        _error(
            f"--recoverable with --max-restarts={a.max_restarts}: the job goes on without a "
            f"dead process instead of restarting the group. Use one of them."
        )
    if a.min_nprocs < a.nprocs:
        _error(
            f"--recoverable with --nprocs={a.min_nprocs}:{a.nprocs} (elastic restarts): the "
            f"job goes on without a dead process instead of restarting the group. Give "
            f"--nprocs {a.nprocs}."
        )
    if a.collective_timeout is None:
        a.collective_timeout = _recoverable.DEFAULT_COLLECTIVE_TIMEOUT_S
    if not a.collective_timeout > 0:
        _error(
            f"--collective-timeout={a.collective_timeout} must be a positive number of "
            f"seconds: a survivor's collective with a dead process must end."
        )
    if a.heartbeat_timeout is None:
        a.heartbeat_timeout = RECOVERABLE_HEARTBEAT_TIMEOUT


def _say(msg: str) -> None:
    print(f"jaxcoll-run: {msg}", file=sys.stderr, flush=True)


@dataclass
class _Traces:
    """The flight records' directory, and whether to keep it (given, or reported on)."""

    path: str
    keep: bool


def _analyse(group: _Group, expected: int, failed: bool, traces: _Traces) -> None:
    """Print what the processes' flight records say (:mod:`jaxcoll.trace`): after a failure
    always, after a clean run only when they disagree. Keeps the records when it printed."""
    records = trace.load(group.trace_dir)
    if not records or not (failed or trace.analyze(records)):
        return
    head = "flight records" if failed else "warning: the processes' flight records disagree"
    _say(f"{head} (python -m jaxcoll.trace {group.trace_dir}):")
    for line in trace.report(records, expected):
        _say(f"  {line}")
    traces.keep = True


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The checked options (``--nprocs`` as ``nprocs`` = MAX and ``min_nprocs`` = MIN)."""
    a = _parser().parse_args(argv)
    _check(a)
    return a


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the job, and return its exit code."""
    a = _parse(argv)
    args = list(a.args)
    if args[:1] == ["--"]:
        args = args[1:]
    command = [sys.executable, "-u", *(["-m"] if a.module else []), a.program, *args]

    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    traces = _Traces(
        a.trace_dir or tempfile.mkdtemp(prefix="jaxcoll-trace-"), keep=a.trace_dir is not None
    )
    try:
        return _supervise(a, command, traces, received)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if not traces.keep:  # a clean run's records say nothing
            shutil.rmtree(traces.path, ignore_errors=True)


def _supervise(
    a: argparse.Namespace, command: list[str], traces: _Traces, received: list[int]
) -> int:
    """Run the group, restarting it (or, elastic, a smaller one) after a failure while the
    options allow; the job's exit code."""
    if a.recoverable:
        return _supervise_recoverable(a, command, traces, received)
    restart = 0  # generations started after the first (JAXCOLL_RESTART_COUNT)
    retries = 0  # restarts at the current size
    slots = list(range(a.nprocs))  # the original local ranks still in the job
    while True:
        group = _Group(a, command, restart, traces.path, slots)
        n = a.nnodes * len(slots)
        failed = _wait(group, received)
        if failed is None:
            sig = received[0]
            _say(
                f"received {signal.Signals(sig).name}; forwarding it to "
                f"{len(group.procs)} process(es)."
            )
            group.stop(a.grace, sig)
            group.join_output()
            _analyse(group, n, True, traces)
            return 128 + sig
        if not failed:
            group.join_output()
            _analyse(group, n, False, traces)
            return 0
        proc = _stop_after_failure(a, group)
        _analyse(group, n, True, traces)
        if retries < a.max_restarts:
            restart += 1
            retries += 1
            _say(
                f"restarting all {len(slots)} process(es) (restart {retries} of {a.max_restarts})."
            )
            continue
        if len(slots) > a.min_nprocs:
            # Elastic: the process that failed last goes; the survivors restart on their
            # own devices, from the job's checkpoints (more examples per device).
            gone = slots.pop(proc.index - a.node_rank * len(group.slots))
            restart += 1
            retries = 0
            _say(
                f"process {proc.index} failed {a.max_restarts + 1} time(s) in a row; "
                f"going on without it (its devices, local slot {gone}): restarting "
                f"{len(slots)} process(es) (--nprocs {a.min_nprocs}:{a.nprocs})."
            )
            continue
        code = proc.popen.returncode
        _say(f"failed: process {proc.index} {describe_exit(code)}{because(proc)}.")
        return code if code > 0 else 128 - code


def _supervise_recoverable(
    a: argparse.Namespace, command: list[str], traces: _Traces, received: list[int]
) -> int:
    """--recoverable: one group, going on without the processes other than 0 that die."""
    group = _Group(a, command, 0, traces.path, list(range(a.nprocs)))
    n = a.nnodes * a.nprocs
    code = _recoverable.supervise(a, group, received, _say, _SETTLE_S)
    if code is None:
        sig = received[0]
        _say(
            f"received {signal.Signals(sig).name}; forwarding it to {len(group.procs)} process(es)."
        )
        group.stop(a.grace, sig)
        group.join_output()
        code = 128 + sig
    if code or not group.lost:  # a lost process leaves no record: nothing to compare
        _analyse(group, n, code != 0, traces)
    return code


def _wait(group: _Group, received: list[int]) -> list[Proc] | None:
    """Poll the group until a process fails or all are done (the failures, none for a clean
    run), or until the launcher receives a signal (None)."""
    while not received:
        failed = group.failures()
        if failed or group.all_done():
            return failed
        time.sleep(_POLL_S)
    return None


def _stop_after_failure(a: argparse.Namespace, group: _Group) -> Proc:
    """Give the others time to end by themselves, stop the rest, and say which process failed
    first (the cause, returned) and which after it."""
    group.settle(_SETTLE_S)
    proc = group.first_cause()
    others = [p.index for p in group.procs if p.exited_at is None]
    rest = (
        f"stopping process(es) {others} (SIGTERM, SIGKILL after {a.grace:g}s)"
        if others
        else "every other process has ended"
    )
    _say(
        f"process {proc.index} (pid {proc.popen.pid}) {describe_exit(proc.popen.returncode)} "
        f"first; {rest}."
    )
    group.stop(a.grace)
    group.join_output()
    for p in group.failures():
        if p is not proc:
            _say(f"then process {p.index} {describe_exit(p.popen.returncode)}{because(p)}.")
    return proc


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``jaxcoll-run``."""
    raise SystemExit(run(argv))
