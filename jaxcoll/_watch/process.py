"""This process in the job: the watchdog's settings, the key-value store, ending with one line.

The settings: the collective timeout (``jaxcoll.init(timeout=)``, ``JAXCOLL_TIMEOUT``) and
detail mode (``jaxcoll.init(debug="detail")``, ``JAXCOLL_DEBUG=detail``). ``on`` and
``detail`` are the gates hot paths read before doing anything (a module attribute lookup).
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from .._jax import distributed_state  # the job's key-value store client

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective may wait in a multi-process job before the watchdog ends the process.

torch's NCCL default. It must exceed the longest legitimate wait of one process for another in
a collective: a peer writing a checkpoint, compiling a slower program, loading data. Ten
minutes covers those and still ends a hung job instead of letting it hold every device for
ever. Scripts that know their steps are short set less (``--timeout``, ``JAXCOLL_TIMEOUT``).
"""
PREFIX = "jaxcoll/"  # every key jaxcoll puts in the job's key-value store starts with this
KV_S = 2.0  # the longest a key-value call of a background thread may take before giving up

on: bool = bool(os.environ.get("JAXCOLL_TIMEOUT", "").strip())
"""A collective timeout is set (or set in the environment and not yet read): register."""
detail: bool = os.environ.get("JAXCOLL_DEBUG", "").strip().lower() == "detail"
"""Mismatch detection is on: fingerprint each program at its first use."""
timeout: float | None = None
"""The collective timeout in seconds, None when off (see :func:`configure`)."""
configured = False
lock = threading.Lock()
_kv_broken = False


def _parse_timeout(api: str, value: Any, source: str) -> float | None:
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{api}: {source}={text!r} is not a number of seconds. Set it to "
                             f"e.g. 600, or 0 to turn the watchdog off.") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{api}: timeout must be a number of seconds, got {value!r} of type "
                        f"{type(value).__name__} instead.")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{api}: {source}={value} must be 0 (off) or a positive number of "
                         f"seconds.")
    return None if value == 0 or math.isinf(value) else float(value)


def _parse_debug(api: str, value: Any, source: str) -> bool:
    text = str(value).strip().lower()
    if text in ("", "off", "0", "false"):
        return False
    if text == "detail":
        return True
    raise ValueError(f"{api}: {source}={value!r} is not 'detail' or 'off'. Set "
                     f"JAXCOLL_DEBUG=detail to check that every process runs the same "
                     f"collectives.")


def configure(timeout_s: float | str | None = "env", debug: str | None = "env",
              joined: bool | None = None, api: str = "init") -> None:
    """Settle the timeout and detail mode: the arguments, else the environment, else defaults.

    ``"env"`` (or None) reads ``JAXCOLL_TIMEOUT`` / ``JAXCOLL_DEBUG``. Unset, the timeout is
    :data:`DEFAULT_TIMEOUT` in a multi-process job (``joined``; default: whether this process
    joined one) and off in a single process; 0 turns it off.
    """
    global on, detail, timeout, configured
    env = os.environ
    if joined is None:
        joined = client() is not None
    if timeout_s == "env" or timeout_s is None:
        raw = env.get("JAXCOLL_TIMEOUT", "").strip()
        t = _parse_timeout(api, raw, "JAXCOLL_TIMEOUT") if raw else \
            (DEFAULT_TIMEOUT if joined else None)
    else:
        t = _parse_timeout(api, timeout_s, "timeout")
    if debug == "env" or debug is None:
        d = _parse_debug(api, env.get("JAXCOLL_DEBUG", ""), "JAXCOLL_DEBUG")
    else:
        d = _parse_debug(api, debug, "debug")
    with lock:
        timeout, detail, on, configured = t, d, t is not None, True


def collective_timeout() -> float | None:
    """The collective timeout in seconds, or None when the watchdog is off."""
    if not configured:
        configure()
    return timeout


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

    th = threading.Thread(target=run, name="jaxcoll-kv", daemon=True)
    th.start()
    th.join(wait_s)
    if th.is_alive():
        _kv_broken = True
        return None
    return box[0] if box else None


def exited() -> list[int]:
    """The processes that recorded a normal exit (see :func:`mark_exit`)."""
    entries = kv(lambda c: c.key_value_dir_get(f"{PREFIX}exited/")) or []
    return sorted(int(k.rsplit("/", 1)[1]) for k, _ in entries)


def mark_exit() -> None:
    """Record in the store that this process is exiting normally."""
    k = me()[0]
    kv(lambda c: c.key_value_set(f"{PREFIX}exited/{k}", "0", allow_overwrite=True))


def say(line: str) -> None:
    """Write one line to stderr at once, from any thread (no Python buffer, no lock)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def die(line: str, code: int) -> None:
    """Print ``line`` and end the process now with ``code``, from any thread.

    ``os._exit``: no atexit hooks, so no wait at JAX's shutdown barrier for peers that may be
    stuck with this process.
    """
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    try:
        say(line)
    finally:
        os._exit(code)


def ranges(items: Any) -> str:
    """``0-3,5`` for ``[0, 1, 2, 3, 5]``."""
    items = sorted(items)
    out, i = [], 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if j == i else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)
