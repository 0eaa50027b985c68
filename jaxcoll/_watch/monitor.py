"""A peer's failure ends this process too, with a line naming the peer.

In a multi-process job a background thread reads the processes that ended on a failure
(``failed/<k>`` in the job's key-value store, written by :func:`process.leave`) every
:data:`POLL_S` seconds. When it finds one, this process leaves as well (exit code 1), whatever
its main thread is doing: blocked in a collective with the failed process, computing, or
spinning in Python. Without it such a process would wait for its collective timeout, or be
aborted by JAX once the coordination service's host is gone.
"""

from __future__ import annotations

import threading
import time

from . import process

POLL_S = 0.5

_thread: threading.Thread | None = None


def start() -> None:
    """Start the thread once, in a process that joined a multi-process job."""
    global _thread
    if process.client() is None:
        return
    with process.lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="jaxcoll-monitor", daemon=True)
            _thread.start()


def stop(wait_s: float = 4 * POLL_S) -> None:
    """At a normal exit (after :func:`process.mark_exit`): wait, at most ``wait_s``, for the
    thread to see it and return. A daemon thread still inside a call to the key-value store
    when Python finalizes is unwound by the C library on its way back ("FATAL: exception not
    rethrown", SIGABRT), which ended a loaded 2-process job that had trained to the end."""
    th = _thread
    if th is not None and th is not threading.current_thread():
        th.join(wait_s)


def _run() -> None:
    me, n = process.me()
    while process.client() is not None:
        time.sleep(POLL_S)
        if process.exiting:  # at JAX's shutdown barrier: a failing peer joins it (leave)
            return
        failed = {k: v for k, v in process.failed().items() if k != me}
        if failed:
            k = min(failed)
            process.leave(
                1,
                f"jaxcoll: process {me} of {n} stops: process {k} failed "
                f"({failed[k].rstrip('.')}); exiting with code 1.",
            )
