"""This process in the job: the watchdog's settings, the key-value store, ending with one line.

The settings: the two collective timeouts (``jaxcoll.init(timeout=, first_timeout=)``,
``JAXCOLL_TIMEOUT``, ``JAXCOLL_FIRST_TIMEOUT``) and detail mode
(``jaxcoll.init(debug="detail")``, ``JAXCOLL_DEBUG=detail``), one frozen :class:`Settings`
value in :data:`settings`; its ``on`` and ``detail`` are the gates hot paths read before doing
anything (two attribute lookups).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from .._jax import distributed_state  # the job's key-value store client
from ..trace import ranges as ranges  # ``0-3,5`` for ``[0, 1, 2, 3, 5]``

DEFAULT_TIMEOUT = 300.0
"""Seconds a program that has completed before may wait before the watchdog ends the process
(``timeout``), in a multi-process job and in a single process alike.

Once a program has run, its compile is done on every process; what a peer may still
legitimately be doing while this one waits in the collective is a step's host work, a
synchronous checkpoint write or an evaluation of its own, which take seconds to a few minutes.
Five minutes covers those and frees a hung job's devices twice as fast as torch's 10-minute
NCCL default (torchtitan uses 100 s per step after the first). Scripts that know their steps
are short set less (``--timeout``, ``JAXCOLL_TIMEOUT``).
"""
DEFAULT_FIRST_TIMEOUT = 600.0
"""Seconds a program may wait before its first completion on this process
(``first_timeout``; never less than ``timeout``).

The first run of a program waits for every peer to reach it: the peers' compiles of the same
program (minutes for a large model, not equal across hosts, plus GPU autotuning), their first
checkpoint restore and data start-up. torch's NCCL default (10 minutes) covers them.
"""
DEFAULT_TRACE_BUFFER = 2000
"""Calls the flight recorder keeps (``JAXCOLL_TRACE_BUFFER``; 0 = off): torch's default."""
PREFIX = "jaxcoll/"  # every key jaxcoll puts in the job's key-value store starts with this
KV_S = 2.0  # the longest a key-value call of a background thread may take before giving up


@dataclasses.dataclass(frozen=True)
class Settings:
    """The watchdog's, the flight recorder's and mismatch detection's settings: one frozen
    value that :func:`configure` replaces whole (as ``jax.config`` or c10d's ``Options``), so
    a reader that takes :data:`settings` once sees one consistent set."""

    on: bool = True
    """Register each dispatched program with the watchdog and the flight recorder: a
    collective timeout is set (the default, in one process too), or this process is in a
    multi-process job, where the flight recorder is on even with the watchdog off. True until
    the first call settles the settings (:func:`configure`)."""
    watching: bool = False
    """A collective timeout is set: the watchdog may end the process."""
    detail: bool = False
    """Mismatch detection is on: fingerprint each program at its first use."""
    timeout: float | None = None
    """The collective timeout in seconds once a program has completed, None when off."""
    first_timeout: float | None = None
    """The collective timeout in seconds before a program's first completion, None when
    off."""
    trace_buffer: int = DEFAULT_TRACE_BUFFER
    """How many calls the flight recorder keeps (0: it records nothing)."""
    configured: bool = False
    """:func:`configure` has run."""


settings = Settings(detail=os.environ.get("JAXCOLL_DEBUG", "").strip().lower() == "detail")
"""The settings in force (replaced by :func:`configure`, never changed in place)."""
lock = threading.Lock()
_kv_broken = False


def _parse_timeout(api: str, value: Any, source: str) -> float | None:
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"{api}: {source}={text!r} is not a number of seconds. Set it to "
                f"e.g. 600, or 0 to turn the watchdog off."
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{api}: timeout must be a number of seconds, got {value!r} of type "
            f"{type(value).__name__} instead."
        )
    if math.isnan(value) or value < 0:
        raise ValueError(
            f"{api}: {source}={value} must be 0 (off) or a positive number of seconds."
        )
    return None if value == 0 or math.isinf(value) else float(value)


def _parse_debug(api: str, value: Any, source: str) -> bool:
    text = str(value).strip().lower()
    if text in ("", "off", "0", "false"):
        return False
    if text == "detail":
        return True
    raise ValueError(
        f"{api}: {source}={value!r} is not 'detail' or 'off'. Set "
        f"JAXCOLL_DEBUG=detail to check that every process runs the same "
        f"collectives."
    )


def configure(
    timeout_s: float | str | None = "env",
    debug: str | None = "env",
    joined: bool | None = None,
    api: str = "init",
    first_timeout_s: float | str | None = "env",
) -> None:
    """Settle the timeouts and detail mode: the arguments, else the environment, else defaults.

    ``"env"`` (or None) reads ``JAXCOLL_TIMEOUT`` / ``JAXCOLL_FIRST_TIMEOUT`` /
    ``JAXCOLL_DEBUG``. Unset, the timeout is :data:`DEFAULT_TIMEOUT`, in a single process as
    in a multi-process job (``joined``; default: whether this process joined one), so a stall
    ends with a line naming the call instead of silence; 0 turns it off (the flight recorder
    stays on in a multi-process job). The first-completion timeout is, unset,
    :data:`DEFAULT_FIRST_TIMEOUT` or the timeout if that is longer, and off when the timeout
    is off; it may not be shorter than the timeout.
    """
    global settings
    env = os.environ
    if joined is None:
        joined = client() is not None
    if timeout_s == "env" or timeout_s is None:
        raw = env.get("JAXCOLL_TIMEOUT", "").strip()
        t = _parse_timeout(api, raw, "JAXCOLL_TIMEOUT") if raw else DEFAULT_TIMEOUT
        t_source = "JAXCOLL_TIMEOUT"
    else:
        t = _parse_timeout(api, timeout_s, "timeout")
        t_source = "timeout"
    if first_timeout_s == "env" or first_timeout_s is None:
        raw = env.get("JAXCOLL_FIRST_TIMEOUT", "").strip()
        first = _parse_timeout(api, raw, "JAXCOLL_FIRST_TIMEOUT") if raw else None
        f_source = "JAXCOLL_FIRST_TIMEOUT"
        given = bool(raw)
    else:
        first = _parse_timeout(api, first_timeout_s, "first_timeout")
        f_source, given = "first_timeout", True
    if not given:
        first = None if t is None else max(DEFAULT_FIRST_TIMEOUT, t)
    elif t is not None and (first is None or first < t):
        raise ValueError(
            f"{api}: {f_source}={first or 0:g} is shorter than {t_source}={t:g}: the wait "
            f"before a program's first completion includes the peers' compiles and start-up, "
            f"so it may not be shorter. Set {f_source} to at least {t:g}, or leave it unset "
            f"(max({DEFAULT_FIRST_TIMEOUT:g}, {t_source}))."
        )
    if debug == "env" or debug is None:
        d = _parse_debug(api, env.get("JAXCOLL_DEBUG", ""), "JAXCOLL_DEBUG")
    else:
        d = _parse_debug(api, debug, "debug")
    raw = env.get("JAXCOLL_TRACE_BUFFER", "").strip()
    try:
        buffer = int(raw) if raw else DEFAULT_TRACE_BUFFER
    except ValueError:
        buffer = -1
    if buffer < 0:
        raise ValueError(
            f"{api}: JAXCOLL_TRACE_BUFFER={raw!r} is not a count of calls. Set it to e.g. "
            f"{DEFAULT_TRACE_BUFFER}, or 0 to turn the flight recorder off."
        )
    watching = t is not None or first is not None
    with lock:
        settings = Settings(
            on=watching or (joined and buffer > 0),
            watching=watching,
            detail=d,
            timeout=t,
            first_timeout=first,
            trace_buffer=buffer,
            configured=True,
        )


def collective_timeout(first: bool = False) -> float | None:
    """The collective timeout in seconds (``first``: before a program's first completion), or
    None when the watchdog is off."""
    if not settings.configured:
        configure()
    now = settings
    return now.first_timeout if first else now.timeout


def client() -> Any:
    """``jax.distributed``'s client (its key-value store), or None outside a job."""
    return distributed_state().client


def hosts_coordinator() -> bool:
    return distributed_state().service is not None


def me() -> tuple[int, int]:
    """(this process's index, the number of processes), without starting a backend."""
    state = distributed_state()
    return (state.process_id, state.num_processes) if state.client is not None else (0, 1)


def kv(call: Callable[[Any], Any], wait_s: float = KV_S) -> Any:
    """``call(client)`` in a helper thread, given up after ``wait_s`` (None on any failure).

    Key-value reads have no deadline of their own and would block for ever once the
    coordinator is gone; a watchdog must still get to speak. After one such hang, every later
    call returns None at once.
    """
    global _kv_broken
    c = client()
    if c is None or _kv_broken:
        return None
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call(c))
        except Exception:  # noqa: BLE001 - a missing key or a gone coordinator: no answer
            box.append(None)
        finally:
            with _helpers_lock:
                _helpers.discard(threading.current_thread())

    th = threading.Thread(target=run, name="jaxcoll-kv", daemon=True)
    with _helpers_lock:
        _helpers.add(th)
    th.start()
    th.join(wait_s)
    if th.is_alive():
        _kv_broken = True
        return None
    return box[0] if box else None


_helpers: set[threading.Thread] = set()
_helpers_lock = threading.Lock()


def join_helpers(wait_s: float = KV_S) -> None:
    """At a normal exit: wait, at most ``wait_s`` in all, for the key-value calls of helper
    threads still in flight. A daemon thread that returns from jaxlib while Python finalizes
    is unwound by the C library through jaxlib's frames ("terminate called ... FATAL:
    exception not rethrown", SIGABRT) after the job ended well."""
    deadline = time.monotonic() + wait_s
    with _helpers_lock:
        left = list(_helpers)
    for th in left:
        th.join(max(0.0, deadline - time.monotonic()))


def _marked(kind: str) -> dict[int, str]:
    """Process -> value of every ``jaxcoll/<kind>/<process>`` key in the store."""
    entries = kv(lambda c: c.key_value_dir_get(f"{PREFIX}{kind}/")) or []
    return {int(k.rsplit("/", 1)[1]): v for k, v in entries}


def exited() -> list[int]:
    """The processes that began a normal exit (see :func:`mark_exit`)."""
    return sorted(_marked("exited"))


def failed() -> dict[int, str]:
    """Process -> the line it ended with, for every process that ended on a failure."""
    return _marked("failed")


def exchange(
    key: str,
    value: str,
    processes: Iterable[int],
    timeout: float,
    missing: Callable[[int, str], Exception],
) -> dict[int, str]:
    """Every process's entry under ``key`` in the job's key-value store, this one's ``value``.

    Writes ``value`` under ``key + str(me)``, then waits for the entry of each process in
    ``processes``: up to ``timeout`` seconds in all. Raises ``missing(p, gone)`` when process
    ``p`` ended first (``gone``: it exited or failed) or its entry did not come in time.
    Returns process -> entry, this process's included.
    """
    client, this = distributed_state().client, me()[0]
    client.key_value_set(key + str(this), value)
    deadline = time.monotonic() + timeout
    got = {this: value}
    for p in processes:
        while p not in got:
            try:
                got[p] = str(client.blocking_key_value_get(key + str(p), 500))
                continue
            except Exception:  # noqa: BLE001 - not there yet
                pass
            if p in exited() or p in failed():
                raise missing(p, "ended first")
            if time.monotonic() > deadline:
                raise missing(p, f"did not get there within {timeout:g}s")
    return got


exiting = False
"""This process began its normal exit (Python's ``atexit``): it waits at JAX's shutdown
barrier for the others and must not leave it on another's failure (see :func:`leave`)."""


def mark_exit() -> None:
    """Record in the store that this process is exiting normally."""
    global exiting
    exiting = True
    k = me()[0]
    kv(lambda c: c.key_value_set(f"{PREFIX}exited/{k}", "0", allow_overwrite=True))


def say(line: str) -> None:
    """Write one line to stderr at once, from any thread (no Python buffer, no lock)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


LEAVE_S = 10.0
"""The longest the process hosting the coordination service waits, when it fails, for the
others to leave first (they learn of its failure within a second or two; see :func:`leave`)."""

_leaving = threading.Lock()

on_leave: Callable[[str], None] | None = None
"""Called with the reason as :func:`leave` ends the process, before its line: the flight
recorder's dump (:mod:`.recorder`)."""


def leave(
    code: int,
    line: str | None = None,
    reason: str | None = None,
    before: Callable[[], None] | None = None,
    report: Callable[[], None] | None = None,
) -> None:
    """End this process with ``code`` after ``line``, without pulling the job from under the
    others: the only way a jaxcoll process ends early, from any thread.

    JAX aborts every process (SIGABRT, "Terminating process because the JAX distributed
    service detected fatal errors") whose coordination service goes away: the service runs in
    process 0, and a process that loses it cannot hand the abort to Python. So in a
    multi-process job:

    * ``reason`` (default ``line``) goes into the store as ``failed/<me>``: the other processes
      poll it (:func:`monitor`) and leave too, each with its own line naming this one;
    * the process hosting the service leaves last: it waits (at most :data:`LEAVE_S`) until
      every other process has recorded that it is gone;
    * when every other process is already in its normal exit, waiting at JAX's shutdown
      barrier for this one, this one joins the barrier first, so that they finish cleanly.

    ``os._exit``: no atexit hooks run, so there is no wait at JAX's shutdown barrier for peers
    that may be stuck in a collective with this process. A second call (another thread) waits
    for the first to end the process, without printing anything. ``report`` (printing an
    error's traceback) and then ``before`` run first (an error all processes raise together
    waits there until every process has printed its own).
    """
    if not _leaving.acquire(blocking=False):
        while True:  # another thread is ending the process
            time.sleep(1.0)
    try:
        try:
            if report is not None:
                report()
            sys.stdout.flush()
            if before is not None:
                before()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        if on_leave is not None:
            try:
                on_leave(reason or line or f"exit {code}")
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        if line is not None:
            say(line)
        if client() is not None:
            _release(reason or line)
    finally:
        os._exit(code)


def _release(reason: str | None) -> None:
    """Tell the others this process ends; see that none loses the coordination service."""
    k, n = me()
    if reason is not None:
        kv(lambda c: c.key_value_set(f"{PREFIX}failed/{k}", reason[:400], allow_overwrite=True))
    others = set(range(n)) - {k}
    host = hosts_coordinator()
    deadline = time.monotonic() + LEAVE_S
    while True:
        gone = set(_marked("gone"))
        waiting = others - gone
        if waiting and not gone and waiting <= set(exited()):
            _join_shutdown()  # they wait for this process at JAX's shutdown barrier
            return
        if not host or not waiting or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not host:
        kv(lambda c: c.key_value_set(f"{PREFIX}gone/{k}", "1", allow_overwrite=True))
    elif not waiting:
        time.sleep(GONE_S)  # their os._exit, just after their record, completes


GONE_S = 1.0
"""How long the coordination service's host waits after the others' last "gone" record: the
time their ``os._exit`` may take to complete on a loaded machine."""


def _join_shutdown() -> None:
    """``jax.distributed.shutdown()`` from a helper thread, given up after :data:`LEAVE_S`."""
    th = threading.Thread(target=_shutdown_quietly, name="jaxcoll-leave", daemon=True)
    th.start()
    th.join(LEAVE_S)


def _shutdown_quietly() -> None:
    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass


def die(line: str, code: int) -> None:
    """Print ``line`` and end the process now with ``code`` (see :func:`leave`)."""
    leave(code, line)
