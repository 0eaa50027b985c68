"""No job hangs: a collective watchdog, mismatch detection, exit markers and SIGTERM handling.

A process-level unit beside :mod:`jaxcoll._init`: it imports nothing of jaxcoll, so ``dist``,
``dp`` and ``bench`` can all use it. What it does, once :func:`jaxcoll.init` has called
:func:`start` (or, for a single process, once ``JAXCOLL_TIMEOUT`` is set):

* **Watchdog.** :func:`register` appends ``(time, outputs, what, inputs)`` to a deque (about a
  microsecond; the caller never waits). A daemon thread checks the oldest pending entry every
  :data:`POLL_S` seconds with ``jax.Array.is_ready()``. When it has not finished within the
  timeout, or for :data:`LEFT_GRACE_S` seconds after a process it needs recorded that it
  exited, the thread prints ONE line naming this process, the program, its shapes and how long
  it waited, and ends the process (exit code 1) before XLA's own checks abort it.
* **Mismatch detection** (``JAXCOLL_DEBUG=detail``): :func:`agree` publishes a program's
  fingerprint in ``jax.distributed``'s key-value store under a per-process sequence number and
  compares it with every other process's, raising on every process when they differ.
* **Exit markers.** At exit each process records ``jaxcoll/exited/<k>`` before JAX's shutdown
  barrier, so a peer's watchdog names the process that left instead of waiting.
* **SIGTERM.** JAX's preemption notifier swallows SIGTERM. :func:`start` replaces it with a
  handler that ends the process at once (exit code 143) unless a loop claimed the signal with
  :func:`handle_preemption`; then the loop polls :func:`preemption_point` at step boundaries.
  A helper thread reads the signal from a wakeup pipe, so it acts even while the main thread is
  blocked in C++ (a stuck collective), where a Python handler would never run.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax._src import distributed as _distributed  # the job's key-value store client
from jax._src.array import ArrayImpl as _ArrayImpl

__all__ = [
    "DEFAULT_TIMEOUT",
    "agree",
    "handle_preemption",
    "preemption_point",
    "preemption_requested",
    "register",
    "start",
    "timeout",
    "watch",
    "watch_outputs",
]

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective may wait in a multi-process job before the watchdog ends the process.

torch's NCCL default. It must exceed the longest legitimate wait of one process for another in
a collective: a peer writing a checkpoint, compiling a slower program, loading data. Ten
minutes covers those and still ends a hung job instead of letting it hold every device for
ever. Scripts that know their steps are short set less (``--timeout``, ``JAXCOLL_TIMEOUT``).
"""
POLL_S = 0.25
LEFT_GRACE_S = 1.5
SIGTERM_EXIT = 128 + signal.SIGTERM
_KV_S = 2.0  # longest a key-value call of the watchdog's may take before it is given up
_PREFIX = "jaxcoll/"

# The gate callers read before calling register (a module attribute lookup: tens of ns).
on: bool = bool(os.environ.get("JAXCOLL_TIMEOUT", "").strip())
detail: bool = os.environ.get("JAXCOLL_DEBUG", "").strip().lower() == "detail"

_timeout: float | None = None
_configured = False
_pending: collections.deque = collections.deque()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_seq: dict[str, int] = {}
_exit_registered = False
_kv_broken = False

# SIGTERM and preemption.
_sig_installed = False
_claims = 0
_requested: float | None = None  # monotonic time of this process's SIGTERM
_noticed = False  # some process of the job got one (seen in the key-value store)
_loop_step = -1  # the last step the loop passed to preemption_point
_published: int | None = None  # the step this process put in the key-value store
_stop_step: int | None = None  # the agreed step to stop after
_pcond = threading.Condition()
_preempt_thread: threading.Thread | None = None


# ---------------------------------------------------------------------------------------------
# settings


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


def configure(timeout: float | None | str = "env", debug: str | None = "env",
              joined: bool = False, api: str = "init") -> None:
    """Settle the timeout and detail mode: the arguments, else the environment, else defaults.

    ``timeout="env"`` reads ``JAXCOLL_TIMEOUT``; unset, the timeout is :data:`DEFAULT_TIMEOUT`
    in a multi-process job (``joined``) and off in a single process. 0 turns it off.
    """
    global _timeout, _configured, on, detail
    env = os.environ
    if timeout == "env" or timeout is None:
        raw = env.get("JAXCOLL_TIMEOUT", "").strip()
        if raw:
            t = _parse_timeout(api, raw, "JAXCOLL_TIMEOUT")
        else:
            t = DEFAULT_TIMEOUT if joined else None
    else:
        t = _parse_timeout(api, timeout, "timeout")
    if debug == "env" or debug is None:
        d = _parse_debug(api, env.get("JAXCOLL_DEBUG", ""), "JAXCOLL_DEBUG")
    else:
        d = _parse_debug(api, debug, "debug")
    with _lock:
        _timeout, detail, on, _configured = t, d, t is not None, True
    if t is not None:
        _start_thread()


def timeout() -> float | None:
    """The collective timeout in seconds, or None when the watchdog is off."""
    if not _configured:
        configure()
    return _timeout


def start(timeout: float | None | str = "env", debug: str | None = "env") -> None:
    """After ``jax.distributed.initialize``: configure, take over SIGTERM, mark the exit."""
    global _exit_registered
    joined = _client() is not None
    configure(timeout, debug, joined=joined)
    if not joined:
        return
    _install_sigterm()
    if not _exit_registered:
        # Registered after JAX's own atexit hook, so it runs first: the marker is written
        # before JAX's shutdown barrier, where an early leaver would otherwise wait.
        atexit.register(_mark_exit)
        _exit_registered = True


# ---------------------------------------------------------------------------------------------
# the watchdog


def register(outputs: Any, what: Any, inputs: Any = None) -> None:
    """Watch ``outputs`` (any pytree of ``jax.Array``) of the program ``what`` just dispatched.

    Never blocks. ``inputs`` (optional) only serves the message: its shapes are printed.
    """
    if not _configured:
        configure()
    if _timeout is not None:
        _pending.append((time.monotonic(), outputs, what, inputs))


def watch_outputs(outputs: Any, what: str) -> Any:
    """Put ``outputs`` of a dispatched program under the watchdog; return them unchanged.

    The hook for a loop that runs its own jitted step (``dp.Trainer`` registers each step's
    outputs): if they are not computed within the timeout, the process ends with one line
    naming ``what``, their shapes and how long it waited. Costs about a microsecond and never
    waits; does nothing while the watchdog is off. Mismatch detection is not done here (it
    needs the program and its inputs before the call): use :func:`watch` for that.

    Example (one process; ``JAXCOLL_TIMEOUT=60``)::

        >>> state, loss = jaxcoll.watch_outputs(step(state, batch), "train step 12")
    """
    register(outputs, what)
    return outputs


def _first_leaf(tree: Any) -> Any:
    if type(tree) is _ArrayImpl:  # the common case, without flattening a pytree
        return tree
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            return leaf
    return None


def _done(leaf: Any) -> bool:
    if leaf is None:
        return True
    try:
        if leaf.is_deleted():  # is_ready() of a deleted array can crash the process
            return True
        return bool(leaf.is_ready())
    except Exception:  # noqa: BLE001 - donated or otherwise gone: not ours to wait for
        return True


def _start_thread() -> None:
    global _thread
    with _lock:
        if _thread is not None and _thread.is_alive():
            return
        _thread = threading.Thread(target=_watchdog, name="jaxcoll-watchdog", daemon=True)
        _thread.start()


def _watchdog() -> None:
    head_id, head_since, leaf = None, 0.0, None
    left_seen_at: float | None = None
    next_probe = 0.0
    while True:
        time.sleep(POLL_S)
        t = _timeout
        if t is None:
            continue
        while _pending:
            item = _pending[0]
            if id(item) != head_id:
                head_id, leaf = id(item), _first_leaf(item[1])
                head_since = max(item[0], time.monotonic() - POLL_S)
                left_seen_at = None
            if not _done(leaf):
                break
            _pending.popleft()
            head_id, leaf = None, None
        if not _pending or head_id is None:
            continue
        now = time.monotonic()
        waited = now - head_since
        item = _pending[0]
        if waited >= min(1.0, t) and now >= next_probe and _client() is not None:
            next_probe = now + 1.0
            left = [p for p in _exited() if p in _processes(leaf)]
            if left and left_seen_at is None:
                left_seen_at = now
        if waited >= t or (left_seen_at is not None and now - left_seen_at >= LEFT_GRACE_S):
            _fire(item, leaf, waited, t)


def _fire(item: tuple, leaf: Any, waited: float, t: float) -> None:
    _, outputs, what, inputs = item
    me, n = _me()
    desc = f"{what}({_shapes(inputs if inputs is not None else outputs)})"
    procs = _processes(leaf)
    where = f" over processes {_ranges(procs)}" if n > 1 and procs else ""
    _kv(lambda c: c.key_value_set(f"{_PREFIX}stuck/{me}", desc, allow_overwrite=True))
    exited = [p for p in _exited() if p != me and p in procs]
    stuck = _kv(lambda c: c.key_value_dir_get(f"{_PREFIX}stuck/")) or []
    others = []
    if exited:
        others.append(f"process(es) {_ranges(exited)} exited without joining it")
    for key, value in sorted(stuck):
        p = int(key.rsplit("/", 1)[1])
        if p != me and p not in exited:
            others.append(f"process {p} timed out in {value}")
    if not others and n > 1:
        others.append("the other processes have not joined it (they are in another "
                      "collective, or outside any)")
    verb = (f"timed out after {waited:.1f}s (timeout {t:g}s)" if waited >= t
            else f"gave up after {waited:.1f}s")
    line = (f"jaxcoll: process {me} of {n} {verb} waiting for {desc}{where}: "
            f"{'; '.join(others) or 'it never finished'}; exiting with code 1.")
    _die(line, 1)


def _die(line: str, code: int) -> None:
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    try:
        _say(line)
    finally:
        os._exit(code)


def _shapes(tree: Any) -> str:
    leaves = jax.tree_util.tree_leaves(tree)
    parts = []
    for leaf in leaves[:4]:
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            parts.append(type(leaf).__name__)
        else:
            parts.append(f"{dtype}[{','.join(map(str, shape))}]")
    if len(leaves) > 4:
        parts.append(f"... {len(leaves)} arrays")
    return ", ".join(parts)


def _processes(leaf: Any) -> tuple[int, ...]:
    if leaf is None:
        return ()
    try:
        return tuple(sorted({d.process_index for d in leaf.sharding.device_set}))
    except Exception:  # noqa: BLE001 - deleted arrays have no sharding to read
        return ()


def _ranges(items: Any) -> str:
    items = sorted(items)
    out, i = [], 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if j == i else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


# ---------------------------------------------------------------------------------------------
# the key-value store


def _client() -> Any:
    return _distributed.global_state.client


def _me() -> tuple[int, int]:
    """(this process's index, the number of processes), without starting a backend."""
    state = _distributed.global_state
    return (state.process_id, state.num_processes) if state.client is not None else (0, 1)


def _kv(call: Callable[[Any], Any], timeout: float = _KV_S) -> Any:
    """``call(client)`` in a helper thread, given up after ``timeout`` s (None on failure).

    Key-value reads without a deadline would block for ever once the coordinator is gone;
    the watchdog must still speak.
    """
    global _kv_broken
    client = _client()
    if client is None or _kv_broken:
        return None
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call(client))
        except Exception:  # noqa: BLE001 - a missing key or a gone coordinator: no answer
            box.append(None)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        _kv_broken = True
        return None
    return box[0] if box else None


def _exited() -> list[int]:
    entries = _kv(lambda c: c.key_value_dir_get(f"{_PREFIX}exited/")) or []
    return sorted(int(k.rsplit("/", 1)[1]) for k, _ in entries)


def _mark_exit() -> None:
    """At a normal exit: wait for this process's own watched work, then record the exit."""
    t = _timeout
    deadline = time.monotonic() + (t if t is not None else 0.0)
    while _pending and time.monotonic() < deadline:
        time.sleep(0.05)  # the watchdog pops what is done and fires on what is stuck
    me = _me()[0]
    _kv(lambda c: c.key_value_set(f"{_PREFIX}exited/{me}", "0", allow_overwrite=True))


# ---------------------------------------------------------------------------------------------
# mismatch detection


def agree(api: str, fields: dict[str, str], processes: tuple[int, ...]) -> None:
    """Check that every process in ``processes`` runs the program described by ``fields``.

    Each process calls it at the same point (a program's first use); the n-th call over a
    given set of processes compares the n-th fingerprints. Raises ``RuntimeError`` on every
    process, naming each process's differing fields, when they disagree, and when a process
    does not publish its fingerprint within the timeout (or exits first).
    """
    client = _client()
    me, n = _me()
    if client is None or len(processes) < 2 or me not in processes:
        return
    scope = "-".join(map(str, processes)) if len(processes) < n else "all"
    with _lock:
        seq = _seq[scope] = _seq.get(scope, 0) + 1
    key = f"{_PREFIX}fp/{scope}/{seq}/"
    client.key_value_set(key + str(me), json.dumps(fields))
    wait = timeout() or DEFAULT_TIMEOUT
    deadline = time.monotonic() + wait
    got = {me: fields}
    for p in processes:
        while p not in got:
            try:
                got[p] = json.loads(client.blocking_key_value_get(key + str(p), 500))
                continue
            except Exception:  # noqa: BLE001 - not there yet
                pass
            gone = p in _exited()
            if gone or time.monotonic() > deadline:
                why = "exited" if gone else f"did not reach it within {wait:g}s"
                raise RuntimeError(
                    f"{api}: process {p} {why} at collective #{seq} (this process {me} runs "
                    f"{_summary(fields, fields.keys())}). Every process must run the same "
                    f"collectives in the same order; JAXCOLL_DEBUG=detail compares programs at "
                    f"their first use, so process {p} may be in a program it has run before."
                )
    differ = [k for k in dict.fromkeys(k for f in got.values() for k in f)
              if len({json.dumps(f.get(k)) for f in got.values()}) > 1]
    if not differ:
        return
    show = [k for k in differ if k != "program"] or differ
    listing = "; ".join(f"process {p}: {_summary(got[p], show)}" for p in sorted(got))
    error = RuntimeError(f"{api}: processes disagree on the collective #{seq}: {listing}")
    # Every process must get to print it: the first to exit ends the job (the launcher stops
    # the rest; if it hosts the coordinator, a C++ thread ends them). jaxcoll's fail-fast
    # excepthook calls this after printing the traceback and before exiting.
    error._jaxcoll_before_exit = functools.partial(_meet, f"{key}printed/", processes)
    raise error


def _meet(prefix: str, processes: tuple[int, ...], wait_ms: int = 5000) -> None:
    """Record that this process got here, then wait (bounded) until the others have too."""
    client, me = _client(), _me()[0]
    if client is None:
        return
    client.key_value_set(f"{prefix}{me}", "1")
    for p in processes:
        if p != me:
            try:
                client.blocking_key_value_get(f"{prefix}{p}", wait_ms)
            except Exception:  # noqa: BLE001 - gone or slow: exit regardless
                pass


def _summary(fields: dict[str, str], keys: Any) -> str:
    parts = [fields.get("call", "?"), fields.get("args", "")]
    parts += [f"{k}={fields[k]}" for k in keys if k not in ("call", "args") and k in fields]
    return " ".join(p for p in parts if p)


def fingerprint_args(tree: Any) -> str:
    """``float32[2,4], int32[]`` for the leaves of ``tree`` (non-arrays by their repr)."""
    parts = []
    for leaf in jax.tree_util.tree_leaves(tree):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is not None and dtype is not None:
            parts.append(f"{dtype}[{','.join(map(str, shape))}]")
        else:
            parts.append(repr(leaf)[:40])
    return ", ".join(parts)


def program_hash(lowered_text: str) -> str:
    return hashlib.sha256(lowered_text.encode()).hexdigest()[:12]


def processes_of(tree: Any) -> tuple[int, ...]:
    """The processes owning devices of the ``jax.Array`` leaves of ``tree`` (all if none)."""
    procs: set[int] = set()
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            procs |= {d.process_index for d in leaf.sharding.device_set}
    return tuple(sorted(procs)) if procs else tuple(range(_me()[1]))


def watch(fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """Wrap your own jitted SPMD function so that no call of it can hang the job silently.

    Each call dispatches ``fn`` and registers its outputs with the watchdog (never waiting):
    if they are not computed within the collective timeout (``jaxcoll.init(timeout=...)``,
    ``jaxcoll-run --timeout``, ``JAXCOLL_TIMEOUT``), the process ends with one line naming
    ``name``, the input shapes and how long it waited. With ``JAXCOLL_DEBUG=detail`` the first
    call per input shapes also compares ``fn``'s fingerprint (name, shapes, dtypes and, when
    ``fn`` has ``.lower``, a hash of the lowered program) across the processes that own its
    inputs, and raises on every process when they differ.

    Args:
        fn: the function, usually ``jax.jit(jax.shard_map(...))``.
        name: the name messages use (default: ``fn``'s ``__name__``).

    Returns:
        A callable with ``fn``'s signature and results.

    Example (one process; ``JAXCOLL_TIMEOUT=60``)::

        >>> step = jaxcoll.watch(jax.jit(train_step), name="train step")
        >>> state, loss = step(state, batch)
    """
    label = name or getattr(fn, "__name__", None) or type(fn).__name__
    seen: set[Any] = set()

    @functools.wraps(fn)
    def watched(*args: Any, **kwargs: Any) -> Any:
        if detail:
            _check_first_call(fn, label, seen, args, kwargs)
        out = fn(*args, **kwargs)
        if on:
            register(out, label, (args, kwargs))
        return out

    return watched


def _check_first_call(fn: Callable[..., Any], label: str, seen: set[Any], args: tuple,
                      kwargs: dict) -> None:
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    sig = (treedef, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", None)))
                          if hasattr(x, "dtype") else ("static", repr(x)) for x in leaves))
    if sig in seen:
        return
    procs = processes_of((args, kwargs))
    if _client() is not None and len(procs) > 1:
        fields = {"call": label, "args": fingerprint_args((args, kwargs))}
        lower = getattr(fn, "lower", None)
        if lower is not None:
            fields["program"] = program_hash(lower(*args, **kwargs).as_text())
        agree(label, fields, procs)
    seen.add(sig)


# ---------------------------------------------------------------------------------------------
# SIGTERM and preemption


def _install_sigterm() -> None:
    """Replace JAX's SIGTERM handler (it only logs) with ours. Main thread only."""
    global _sig_installed, _sig_pipe
    if _sig_installed or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, _on_sigterm)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:  # someone (asyncio) owns the wakeup fd: keep theirs, use the handler
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
    else:
        _sig_pipe = True
        threading.Thread(target=_read_signals, args=(read_fd,), name="jaxcoll-sigterm",
                         daemon=True).start()
    _sig_installed = True


_sig_pipe = False
_sig_lock = threading.Lock()
_sig_count = 0


def _read_signals(fd: int) -> None:
    while True:
        data = os.read(fd, 64)
        if not data:
            return
        for _ in range(data.count(signal.SIGTERM)):
            _sigterm()


def _on_sigterm(signum: int, frame: Any) -> None:
    """The Python-level handler; it runs only when the main thread runs Python code, so the
    wakeup-pipe thread does the work when there is one."""
    if not _sig_pipe:
        _sigterm()


def _sigterm() -> None:
    global _requested, _sig_count
    with _sig_lock:
        _sig_count += 1
        if _requested is None:
            _requested = time.monotonic()
        count = _sig_count
    me = _me()[0]
    if _claims == 0 or count > 1:
        _die(f"jaxcoll: process {me} received SIGTERM; exiting with code {SIGTERM_EXIT}.",
             SIGTERM_EXIT)
    _say(f"jaxcoll: process {me} received SIGTERM; the training loop will stop at a step "
         f"boundary (a second SIGTERM exits at once).")
    if _client() is not None:
        with _pcond:
            _publish(me)


def _say(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def preemption_requested() -> bool:
    """True once this process got SIGTERM, or (inside :func:`handle_preemption`, in a
    multi-process job) once it learned that another process did.

    Cheap (a global read): a loop may call it every step.
    """
    return _requested is not None or _noticed


@contextlib.contextmanager
def handle_preemption() -> Iterator[None]:
    """Claim SIGTERM for a loop that stops cleanly at a step boundary.

    Outside this block, a process of a multi-process job ends at once on SIGTERM (exit code
    143, one line saying so). Inside it, SIGTERM only records the request: the loop calls
    :func:`preemption_point` after each step and, when it returns True, saves what it needs
    and exits non-zero itself. A second SIGTERM still ends the process at once. In a job of
    several processes the request is shared through the key-value store, so every process
    stops at the same step even when only one was signalled.

    Example::

        >>> with jaxcoll.handle_preemption():
        ...     for step in range(steps):
        ...         state = train_step(state)
        ...         if jaxcoll.preemption_point(step):
        ...             save(state); raise SystemExit(143)
    """
    global _claims, _preempt_thread
    _install_sigterm()
    with _lock:
        _claims += 1
        if _client() is not None and (_preempt_thread is None
                                      or not _preempt_thread.is_alive()):
            _preempt_thread = threading.Thread(target=_preempt_agreement,
                                               name="jaxcoll-preemption", daemon=True)
            _preempt_thread.start()
    try:
        yield
    finally:
        with _lock:
            _claims -= 1


def preemption_point(step: int) -> bool:
    """Call after step ``step`` of a loop inside :func:`handle_preemption`: True = stop now.

    In one process: True once SIGTERM arrived. In several: every process gets True after the
    same step. When a process learns of the request (its own SIGTERM, or another's through
    the key-value store, polled by a background thread) it publishes the last step it
    finished; the stop step is one past the largest published. Until every process has
    published, a process does not pass the step after its own (this call waits, at most the
    collective timeout), so none can overshoot. Without a request it only reads globals.
    """
    global _loop_step
    if _client() is None:
        _loop_step = step
        return _requested is not None
    with _pcond:
        _loop_step = step
        if _published is not None and step > _published:
            limit = timeout() or DEFAULT_TIMEOUT
            if not _pcond.wait_for(lambda: _stop_step is not None, limit):
                raise RuntimeError(
                    f"preemption_point: process {_me()[0]} waited {limit:g}s at step {step} "
                    f"for every process to report its step after a SIGTERM; some never did "
                    f"(are all processes inside jaxcoll.handle_preemption?)."
                )
        return _stop_step is not None and step >= _stop_step


def _publish(me: int) -> None:
    """Put this process's last finished step in the store, once (call with ``_pcond`` held)."""
    global _published, _noticed
    _noticed = True
    if _published is None:
        _published = _loop_step
        _kv(lambda c, s=_published: c.key_value_set(f"{_PREFIX}preempt/{me}", str(s),
                                                    allow_overwrite=True))


def _preempt_agreement() -> None:
    """Background: learn of a request, publish this process's step, agree on the stop step."""
    global _stop_step
    me, n = _me()
    while _claims > 0 and _stop_step is None:
        time.sleep(2 * POLL_S if _published is None else POLL_S / 2)
        entries = _kv(lambda c: c.key_value_dir_get(f"{_PREFIX}preempt/"))
        if not entries:
            continue
        with _pcond:
            _publish(me)
            steps = [int(v) for _, v in entries]
            if len(entries) == n:
                _stop_step = max(steps) + 1
                _pcond.notify_all()
