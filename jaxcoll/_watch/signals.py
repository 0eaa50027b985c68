"""SIGTERM: stop at once, or at the next step boundary of a loop that claimed it; SIGUSR1:
write the flight record (:mod:`.recorder`) and go on.

JAX's preemption notifier catches SIGTERM in every process that called
``jax.distributed.initialize`` and only logs it, so a launcher's or scheduler's stop waits its
whole grace period and ends in SIGKILL. :func:`install` puts a Python handler in its place.
The handler itself runs only when the main thread runs Python code, which a process blocked in
a collective never does; so the signal is also written to a wakeup pipe
(``signal.set_wakeup_fd``) that a helper thread reads and acts on. Outside
:func:`handle_preemption` it ends the process (exit code 143) with one line; inside it, it
records the request, shares it with the other processes through the key-value store, and
:func:`preemption_point` tells every process's loop to stop after the same step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from . import process, recorder

SIGTERM_EXIT = 128 + signal.SIGTERM
_POLL_S = 0.5

_installed = False
_pipe = False
_sig_lock = threading.Lock()
_count = 0
_claims = 0
_requested: float | None = None  # monotonic time of this process's SIGTERM
_noticed = False  # some process of the job got one (seen in the key-value store)
_loop_step = -1  # the last step the loop passed to preemption_point
_published: int | None = None  # the step this process put in the key-value store
_stop_step: int | None = None  # the agreed step to stop after
_cond = threading.Condition()
_agreement: threading.Thread | None = None
_released = threading.Event()
"""Set when the last :func:`handle_preemption` block ends: the agreement thread returns."""


def install() -> None:
    """Replace JAX's SIGTERM handler with jaxcoll's. Main thread only; idempotent."""
    global _installed, _pipe
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGUSR1, _handler)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:  # someone (asyncio) owns the wakeup fd: keep theirs, use the handler
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
    else:
        _pipe = True
        threading.Thread(
            target=_read_pipe, args=(read_fd,), name="jaxcoll-sigterm", daemon=True
        ).start()
    _installed = True


def _read_pipe(fd: int) -> None:
    while True:
        data = os.read(fd, 64)
        if not data:
            return
        for _ in range(data.count(signal.SIGUSR1)):
            _sigusr1()
        for _ in range(data.count(signal.SIGTERM)):
            _sigterm()


def _handler(signum: int, frame: Any) -> None:
    if not _pipe:  # with a pipe, its thread has done the work already
        _sigusr1() if signum == signal.SIGUSR1 else _sigterm()


def _sigusr1() -> None:
    """Write the flight record and go on (``kill -USR1``: where is a running job?)."""
    if not process.settings.on or not process.settings.trace_buffer:
        return
    path = recorder.dump("SIGUSR1")
    process.say(f"jaxcoll: process {process.me()[0]} wrote its flight record to {path}.")


def _sigterm() -> None:
    global _requested, _count
    with _sig_lock:
        _count += 1
        if _requested is None:
            _requested = time.monotonic()
        count = _count
    me = process.me()[0]
    if _claims == 0 or count > 1:
        process.die(
            f"jaxcoll: process {me} received SIGTERM; exiting with code {SIGTERM_EXIT}.",
            SIGTERM_EXIT,
        )
    process.say(
        f"jaxcoll: process {me} received SIGTERM; the training loop will stop at a "
        f"step boundary (a second SIGTERM exits at once)."
    )
    if process.client() is not None:
        with _cond:
            _publish(me)


def preemption_requested() -> bool:
    """True once this process got SIGTERM, or (inside :func:`handle_preemption`, in a
    multi-process job) once it learned that another process did. A global read."""
    return _requested is not None or _noticed


@contextlib.contextmanager
def handle_preemption() -> Iterator[None]:
    """Claim SIGTERM for a loop that stops cleanly at a step boundary.

    In a multi-process job, jaxcoll ends a process at once on SIGTERM (exit code 143, one line
    saying so). Inside this block SIGTERM only records the request: the loop calls
    :func:`preemption_point` after each step and, when it returns True, saves what it needs
    and exits non-zero itself. A second SIGTERM still ends the process at once. Every process
    stops after the same step even when only one was signalled.

    Example::

        >>> with jaxcoll.handle_preemption():
        ...     for step in range(steps):
        ...         state = train_step(state)
        ...         if jaxcoll.preemption_point(step):
        ...             save(state)
        ...             raise SystemExit(143)
    """
    global _claims, _agreement
    install()
    with process.lock:
        _claims += 1
        if process.client() is not None and (_agreement is None or not _agreement.is_alive()):
            _released.clear()
            _agreement = threading.Thread(target=_agree, name="jaxcoll-preemption", daemon=True)
            _agreement.start()
    try:
        yield
    finally:
        with process.lock:
            _claims -= 1
            last = _claims == 0
            agreement = _agreement
        if last and agreement is not None and agreement is not threading.current_thread():
            # The thread stops now, not at its next poll: a key-value call of it still in
            # flight when the process exits would abort it (see process.join_helpers).
            _released.set()
            agreement.join(2 * process.KV_S)


def preemption_point(step: int) -> bool:
    """Call after step ``step`` inside :func:`handle_preemption`: True means stop now.

    In one process: True once SIGTERM arrived. In several, every process gets True after the
    same step: a process that learns of a request (its own SIGTERM, or another's, seen by a
    background thread polling the key-value store every 0.5 s) publishes the last step it
    finished, and the stop step is one past the largest published. Until all have published,
    a process does not pass the step after its own (this call waits, at most the collective
    timeout), so none overshoots. Without a request it takes a lock and reads two globals.
    """
    global _loop_step
    if process.client() is None:
        _loop_step = step
        return _requested is not None
    with _cond:
        _loop_step = step
        if _published is not None and step > _published:
            limit = process.collective_timeout() or process.DEFAULT_TIMEOUT
            if not _cond.wait_for(lambda: _stop_step is not None, limit):
                raise RuntimeError(
                    f"preemption_point: process {process.me()[0]} waited {limit:g}s at step "
                    f"{step} for every process to report its step after a SIGTERM; some never "
                    f"did (is every process's loop inside jaxcoll.handle_preemption?)."
                )
        return _stop_step is not None and step >= _stop_step


def _publish(me: int) -> None:
    """Put this process's last finished step in the store, once (``_cond`` held)."""
    global _published, _noticed
    _noticed = True
    if _published is None:
        _published = step = _loop_step
        process.kv(
            lambda c: c.key_value_set(
                f"{process.PREFIX}preempt/{me}", str(step), allow_overwrite=True
            )
        )


def _agree() -> None:
    """Background: learn of a request, publish this process's step, settle the stop step."""
    global _stop_step
    me, n = process.me()
    while _claims > 0 and _stop_step is None:
        if _released.wait(_POLL_S if _published is None else _POLL_S / 4) or _claims == 0:
            return
        entries = process.kv(lambda c: c.key_value_dir_get(f"{process.PREFIX}preempt/"))
        if not entries:
            continue
        with _cond:
            _publish(me)
            if len(entries) == n:
                _stop_step = max(int(v) for _, v in entries) + 1
                _cond.notify_all()
