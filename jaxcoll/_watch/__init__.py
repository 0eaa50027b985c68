"""No job hangs: a collective watchdog, mismatch detection, exit markers and SIGTERM handling.

A process-level unit beside :mod:`jaxcoll._init` that imports nothing else of jaxcoll, so
``distributed``, ``dp`` and ``bench`` can all use it. :func:`jaxcoll.init` calls :func:`start`
after joining the job; a single process settles the same settings at its first watched call
(``JAXCOLL_TIMEOUT=0`` turns the watchdog off).

* :mod:`.watchdog`: every ``dist`` call, :func:`watch`-ed function and
  :func:`watch_outputs` registration that is not computed within its timeout ends its process
  with one line naming it (by default 600 s until a program's first completion,
  :data:`process.DEFAULT_FIRST_TIMEOUT`, and 300 s after it, :data:`DEFAULT_TIMEOUT`).
* :mod:`.recorder`: the flight recorder, a ring buffer of those calls (op, group, shapes,
  call site, issue and completion times) dumped as JSON when a process ends early, on
  SIGUSR1 and on :func:`dump_trace`; :mod:`jaxcoll.trace` compares the processes' dumps.
* :mod:`.detect`: with ``JAXCOLL_DEBUG=detail``, processes compare each program's fingerprint
  at its first use and raise on every process when they disagree.
* exit markers: a process that exits normally records it before JAX's shutdown barrier, so a
  peer still waiting in a collective with it gives up within seconds, naming it.
* :mod:`.monitor` and :func:`process.leave`: a process that fails records it, the others
  leave within a second or two naming it, and the process hosting JAX's coordination service
  leaves last, so JAX aborts none of them.
* :mod:`.signals`: SIGTERM ends the process at once (exit code 143), or, inside
  :func:`handle_preemption`, stops every process's loop after the same step.
* :func:`pause` / :func:`resume` (or ``with paused():``): the watchdog and the flight
  recorder off for code that expects a lost peer to fail part of a program (``dp.Survivor``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator

from . import monitor as _monitor
from . import process
from . import recorder as _recorder
from . import watchdog as _watchdog
from .detect import agree as agree
from .detect import watch as watch
from .process import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from .process import leave as leave
from .recorder import dump_trace as dump_trace
from .signals import handle_preemption as handle_preemption
from .signals import install as _install_sigterm
from .signals import preemption_point as preemption_point
from .signals import preemption_requested as preemption_requested
from .watchdog import configure as configure
from .watchdog import pause as pause
from .watchdog import register as register
from .watchdog import resume as resume
from .watchdog import watch_outputs as watch_outputs

__all__ = [
    "DEFAULT_TIMEOUT",
    "agree",
    "configure",
    "dump_trace",
    "handle_preemption",
    "pause",
    "paused",
    "preemption_point",
    "preemption_requested",
    "register",
    "resume",
    "start",
    "watch",
    "watch_outputs",
]

_exit_hook = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """This process's watchdog and flight recorder off inside the block (:func:`pause`), and
    back as they were after it (:func:`resume`)::

        >>> with jaxcoll._watch.paused():
        ...     survive_a_lost_peer()
    """
    before = pause()
    try:
        yield
    finally:
        resume(before)


def start(
    timeout: float | str | None = "env",
    debug: str | None = "env",
    first_timeout: float | str | None = "env",
) -> None:
    """After ``jax.distributed.initialize``: configure, take over SIGTERM and SIGUSR1, mark
    the exit."""
    global _exit_hook
    configure(timeout, debug, first_timeout=first_timeout)
    if process.client() is None:
        return
    _install_sigterm()
    _monitor.start()
    if not _exit_hook:
        # Registered after JAX's own atexit hook, so it runs first: the marker is in the store
        # before JAX's shutdown barrier, where an early leaver would otherwise wait 60 s.
        atexit.register(_at_exit)
        _exit_hook = True


def _at_exit() -> None:
    """A normal exit: let this process's watched work finish (the watchdog fires on what is
    stuck), then record the exit for the peers' watchdogs."""
    now = process.settings
    _watchdog.drain(now.first_timeout or now.timeout or 0.0)
    if now.on and now.trace_buffer and os.environ.get("JAXCOLL_TRACE_DIR"):
        _recorder.dump("exit")  # for jaxcoll-run's comparison of the processes' records
    process.mark_exit()
    _monitor.stop()
    process.join_helpers()
