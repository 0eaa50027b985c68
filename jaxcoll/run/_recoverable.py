"""``jaxcoll-run --recoverable``: supervise a job that goes on when a process dies.

The processes run with ``JAXCOLL_RECOVERABLE=1`` (:func:`jaxcoll.init` turns JAX's
recoverability on) and a finite XLA:CPU collective timeout (``--collective-timeout``), so a
survivor's collective with a dead peer raises and :class:`jaxcoll.dp.Survivor` goes on
without it. The launcher then reports a process other than 0 that dies instead of ending the
job, and with ``--replace`` starts one replacement under its id (``JAXCOLL_REPLACEMENT=1``:
the script calls :meth:`~jaxcoll.dp.Survivor.join`). Process 0 hosts JAX's coordination
service: its failure ends the job, as does a failure after it has ended.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from ._group import POLL_S, _Group
from ._output import Proc, because, describe_exit

DEFAULT_COLLECTIVE_TIMEOUT_S = 10.0
"""``--collective-timeout``'s default: seconds a survivor's collective waits for a dead peer
before it raises (XLA:CPU's ``--xla_cpu_collective_timeout_seconds``)."""


def supervise(
    a: argparse.Namespace,
    group: _Group,
    received: list[int],
    say: Callable[[str], None],
    settle_s: float,
) -> int | None:
    """Watch ``group`` until it is done; the job's exit code, or None when the launcher
    received a signal (``received``; the caller forwards it).

    A process other than 0 that fails while process 0 runs is lost: reported, left out, and
    with ``--replace`` started again once under its id. Process 0's failure, or any failure
    after process 0 ended, ends the job (the others get ``settle_s`` to end by themselves,
    then SIGTERM and SIGKILL). Processes still running ``settle_s`` after process 0 ended
    are stopped and fail the job.
    """
    replaced: dict[int, tuple[float, Proc] | None] = {}  # process -> (when due, lost one)
    zero_ended: float | None = None
    while not received:
        for p in group.failures():
            if p.index == 0 or zero_ended is not None:
                return _fail(a, group, p, say, settle_s)
            _lose(a, group, p, replaced, say)
        if zero_ended is None:
            _start_due(group, replaced, say)
        if group.all_done():
            if group.failures():  # failed since the loop above looked: handle it first
                continue
            return _done(group, say)
        zero = [p for p in group.procs if p.index == 0 and p.exited_at is not None]
        if zero and zero_ended is None:
            zero_ended = time.monotonic()
        if zero_ended is not None and time.monotonic() - zero_ended > settle_s:
            still = [p.index for p in group.procs if p.exited_at is None]
            say(
                f"failed: process(es) {still} still running {settle_s:g} s after process 0 "
                f"(the coordination service's host) ended; stopping them."
            )
            group.stop(a.grace)
            group.join_output()
            return 1
        time.sleep(POLL_S)
    return None


def _lose(
    a: argparse.Namespace,
    group: _Group,
    proc: Proc,
    replaced: dict[int, tuple[float, Proc] | None],
    say: Callable[[str], None],
) -> None:
    group.lose(proc)
    left = sum(p.exited_at is None for p in group.procs)
    say(
        f"process {proc.index} (pid {proc.popen.pid}) {describe_exit(proc.popen.returncode)}"
        f"{because(proc)}; the job goes on without it (--recoverable; {left} process(es) "
        f"of this node left)."
    )
    if a.replace and proc.index not in replaced:
        wait = replace_delay(a)
        replaced[proc.index] = (time.monotonic() + wait, proc)
        say(f"starting a replacement for process {proc.index} in {wait:g} s (--replace).")


def replace_delay(a: argparse.Namespace) -> float:
    """Seconds between a loss and its replacement's start: the survivors' failed step may
    wait the collective timeout, and their agreement on the live devices about the
    heartbeat timeout; a replacement that joined sooner would count as alive, and they
    would see no loss."""
    return float(a.collective_timeout + 2 * a.heartbeat_timeout)


def _start_due(
    group: _Group, replaced: dict[int, tuple[float, Proc] | None], say: Callable[[str], None]
) -> None:
    """Start the replacements that are due (each once: its entry becomes None)."""
    now = time.monotonic()
    for index, entry in replaced.items():
        if entry is None or now < entry[0]:
            continue
        replaced[index] = None
        new = group.replace(entry[1])
        say(
            f"started a replacement for process {index} (pid {new.popen.pid}, "
            f"JAXCOLL_REPLACEMENT=1; once per process)."
        )


def _fail(
    a: argparse.Namespace, group: _Group, proc: Proc, say: Callable[[str], None], settle_s: float
) -> int:
    """End the job on ``proc``'s failure: its exit code (or 128 + signal)."""
    group.settle(settle_s)
    group.stop(a.grace)
    group.join_output()
    code = proc.popen.returncode
    why = "it hosts the coordination service" if proc.index == 0 else "after process 0 ended"
    say(f"failed: process {proc.index} {describe_exit(code)}{because(proc)} ({why}).")
    return code if code > 0 else 128 - code


def _done(group: _Group, say: Callable[[str], None]) -> int:
    """Every process of this node has ended, none failing since the last loss: 0, unless
    none ran to the end (every one was lost), then the first loss's code."""
    group.join_output()
    if group.lost:
        lost = [p.index for p in group.lost]
        say(f"done; process(es) {lost} were lost on the way (--recoverable).")
    if group.procs or not group.lost:
        return 0
    code = group.lost[0].popen.returncode
    return code if code > 0 else 128 - code
