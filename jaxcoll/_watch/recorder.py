"""The flight recorder: a ring buffer of every program with collectives this process dispatched.

Each ``dist`` call, ``dp.Trainer`` step and :func:`jaxcoll.watch`-ed call (everything the
watchdog watches, :func:`record`) appends one :class:`Call`: its sequence number in this
process and in its group of processes, the op or program name and options, its input shapes
and dtypes, the user's call site (the first frame outside jaxcoll), when it was issued and
when the watchdog saw it complete. The newest :data:`process.settings.trace_buffer` calls are kept
(2000; ``JAXCOLL_TRACE_BUFFER``).

:func:`dump` writes them as JSON, with the main thread's Python stack, to
``$JAXCOLL_TRACE_DIR/process<k>.json`` (``jaxcoll-run`` sets the directory and analyses what
every process wrote; :mod:`jaxcoll.trace` is the analysis). A process dumps when it ends
early for any reason (its watchdog's timeout, a mismatch, a peer's failure, SIGTERM, an
uncaught error: :func:`process.leave`), at a normal exit under ``jaxcoll-run``, on SIGUSR1,
and on :func:`jaxcoll.dump_trace`.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Any

import jax

from .._jax import ArrayImpl as _ArrayImpl
from . import process

VERSION = 1
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../jaxcoll/


class Call:
    """One recorded program call (a ``__slots__`` object: recording costs about a microsecond)."""

    __slots__ = (
        "done",
        "file",
        "first",
        "group",
        "group_seq",
        "issued",
        "limit",
        "line",
        "options",
        "seq",
        "sig",
        "what",
    )

    seq: int  # in this process
    group: tuple[int, ...]  # the processes its arrays span
    group_seq: int  # in that group
    what: str
    options: str
    sig: Any  # (shape, dtype) of up to 4 input leaves, then the leaf count
    file: str
    line: int
    issued: float  # monotonic

    def __init__(self) -> None:
        self.done: float | None = None  # monotonic time the watchdog saw it complete
        self.first = True  # no call of the same program had completed (set by the watchdog)
        self.limit: float | None = None  # its timeout (set by the watchdog)


_calls: collections.deque[Call] = collections.deque(maxlen=process.DEFAULT_TRACE_BUFFER)
_seq = 0
_group_seq: dict[tuple[int, ...], int] = {}
_groups: dict[Any, tuple[int, ...]] = {}  # sharding -> the processes its devices belong to
_lock = threading.Lock()


def _signature(inputs: Any) -> Any:
    """What is kept of the inputs: (shape, dtype) of up to 4 leaves, and the leaf count."""
    if type(inputs) is _ArrayImpl:
        array: Any = inputs
        return ((array.shape, array.dtype),)
    leaves = jax.tree_util.tree_leaves(inputs)
    sig = tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves[:4])
    return sig if len(leaves) <= 4 else (*sig, len(leaves))


def group_of(leaf: Any) -> tuple[int, ...]:
    """The processes owning the devices ``leaf`` (a ``jax.Array``) lives on (cached per
    sharding)."""
    try:
        sharding = leaf.sharding
    except Exception:  # noqa: BLE001 - deleted or not an array
        return ()
    procs = _groups.get(sharding)
    if procs is None:
        procs = tuple(sorted({d.process_index for d in sharding.device_set}))
        if len(_groups) < 4096:
            _groups[sharding] = procs
    return procs


def _site() -> tuple[str, int]:
    """File and line of the innermost frame outside jaxcoll (the user's call)."""
    f: Any = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_PKG):
        f = f.f_back
    if f is None:
        return "?", 0
    return f.f_code.co_filename, f.f_lineno


def record(leaf: Any, what: str, inputs: Any, options: str) -> Call:
    """Append the call of ``what`` (whose first output is ``leaf``) to the ring buffer."""
    global _seq
    call = Call()
    call.issued = time.monotonic()
    call.what, call.options = what, options
    call.sig = _signature(inputs)
    call.file, call.line = _site()
    group = group_of(leaf)
    with _lock:
        _seq += 1
        call.seq = _seq
        n = _group_seq[group] = _group_seq.get(group, 0) + 1
        if _calls.maxlen != process.settings.trace_buffer:
            _resize()
        if process.settings.trace_buffer:
            _calls.append(call)
    call.group, call.group_seq = group, n
    return call


def _resize() -> None:
    global _calls
    _calls = collections.deque(_calls, maxlen=process.settings.trace_buffer)


def describe(sig: Any) -> str:
    """``float32[4,3], int32[]`` (and ``... 9 arrays``) for a recorded signature."""
    parts = []
    for item in sig:
        if isinstance(item, int):
            parts.append(f"... {item} arrays")
        elif item[0] is None or item[1] is None:
            parts.append("?")
        else:
            parts.append(f"{item[1]}[{','.join(map(str, item[0]))}]")
    return ", ".join(parts)


def _frames(frame: Any, limit: int = 40) -> list[str]:
    out: list[str] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return out[::-1]  # outermost first


def snapshot(reason: str) -> dict[str, Any]:
    """This process's record as a JSON-ready dict."""
    me, n = process.me()
    wall = time.time() - time.monotonic()  # monotonic -> wall clock
    with _lock:
        calls = list(_calls)
        total = _seq
    main = sys._current_frames().get(threading.main_thread().ident or -1)
    out = []
    for c in calls:
        args = describe(c.sig)
        fingerprint = hashlib.sha256(f"{c.what}|{c.options}|{args}".encode()).hexdigest()[:12]
        out.append(
            {
                "seq": c.seq,
                "group": list(c.group),
                "group_seq": c.group_seq,
                "op": c.what,
                "options": c.options,
                "args": args,
                "fingerprint": fingerprint,
                "site": f"{c.file}:{c.line}",
                "issued": round(c.issued + wall, 6),
                "done": None if c.done is None else round(c.done + wall, 6),
            }
        )
    return {
        "version": VERSION,
        "process": me,
        "num_processes": n,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "reason": reason,
        "time": time.time(),
        "calls_recorded": total,
        "timeout": process.settings.timeout,
        "first_timeout": process.settings.first_timeout,
        "calls": out,
        "stack": _frames(main) if main is not None else [],
    }


def default_path() -> str:
    """Where :func:`dump` writes without a path: ``$JAXCOLL_TRACE_DIR/process<k>.json``, else
    ``<tmp>/jaxcoll-trace/process<k>-<pid>.json`` (one process alone:
    ``<tmp>/jaxcoll-trace/<pid>/process0.json``, a directory of its own for the analysis)."""
    me, n = process.me()
    directory = os.environ.get("JAXCOLL_TRACE_DIR")
    if directory:
        return os.path.join(directory, f"process{me}.json")
    if n == 1:
        return os.path.join(
            tempfile.gettempdir(), "jaxcoll-trace", str(os.getpid()), "process0.json"
        )
    return os.path.join(tempfile.gettempdir(), "jaxcoll-trace", f"process{me}-{os.getpid()}.json")


_dump_lock = threading.Lock()


def dump(reason: str = "dump_trace", path: str | os.PathLike | None = None) -> str:
    """Write this process's flight record as JSON; return the file's path."""
    target = os.fspath(path) if path is not None else default_path()
    data = snapshot(reason)
    with _dump_lock:
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        tmp = f"{target}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(tmp, target)  # a reader never sees half a file
    return target


def dump_on_leave(reason: str) -> None:
    """The dump of a process that ends early (:data:`process.on_leave`); a line says where
    unless ``jaxcoll-run`` collects it."""
    if not process.settings.on or not process.settings.trace_buffer:
        return
    path = dump(reason)
    if not os.environ.get("JAXCOLL_TRACE_DIR"):
        process.say(
            f"jaxcoll: process {process.me()[0]} wrote its flight record to {path} "
            f"(python -m jaxcoll.trace {os.path.dirname(path)})"
        )


def dump_trace(path: str | os.PathLike | None = None) -> str:
    """Write this process's flight record (the last calls with collectives it dispatched) as
    JSON, and return the file's path.

    The record holds, for each ``dist`` call, ``dp.Trainer`` step and :func:`jaxcoll.watch`-ed
    call (the newest 2000, ``JAXCOLL_TRACE_BUFFER``): its sequence number in this process and
    in its group of processes, the op, its options and input shapes, the call site
    (``file:line``), when it was issued and when it completed; and this process's Python
    stack now. Recording is on in every multi-process job (``JAXCOLL_TRACE_BUFFER=0`` turns
    it off), and in a single process while the watchdog is on (the default).
    ``python -m jaxcoll.trace DIR`` compares the records of a job's processes and names the
    first that diverged or stalled; ``jaxcoll-run`` does so by itself when a job fails. A
    process also writes its record on SIGUSR1 (``kill -USR1 PID``: a running job's state,
    without stopping it).

    Args:
        path: the file to write (default ``$JAXCOLL_TRACE_DIR/process<k>.json``, else
            ``<tmp>/jaxcoll-trace/process<k>-<pid>.json``; one process alone:
            ``<tmp>/jaxcoll-trace/<pid>/process0.json``).

    Example::

        >>> path = jaxcoll.dump_trace("trace/process0.json")
    """
    return dump("dump_trace", path)
