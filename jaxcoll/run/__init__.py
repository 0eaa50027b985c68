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
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .. import trace
from . import _recoverable
from ._args import HEARTBEAT_TIMEOUT as HEARTBEAT_TIMEOUT
from ._args import RECOVERABLE_HEARTBEAT_TIMEOUT as RECOVERABLE_HEARTBEAT_TIMEOUT
from ._args import _parse as _parse
from ._group import POLL_S as _POLL_S
from ._group import _child_env as _child_env
from ._group import _Group
from ._group import free_port as free_port
from ._output import Proc, because, describe_exit

__all__ = ["main"]


_SETTLE_S = 10.0  # how long the others may take to end by themselves after a failure


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
