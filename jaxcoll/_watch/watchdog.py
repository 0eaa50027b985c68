"""The collective watchdog: no dispatched program may stay unfinished for longer than its timeout.

:func:`register` records the call in the flight recorder (:mod:`.recorder`) and appends it,
with its first output, to a deque: about two microseconds, and the caller never waits. A
daemon thread wakes every :data:`POLL_S` seconds, drops the entries whose outputs are ready
(``jax.Array.is_ready()``, stamping the recorder's completion time) and looks at the oldest
one left. When that one has been the oldest for its timeout, or for :data:`LEFT_GRACE_S`
seconds after a process it needs recorded its exit, the thread prints ONE line naming this
process, the program, its shapes and how long it waited, and ends the process (exit code 1):
before XLA:CPU's own abort of a stuck rendezvous (a C++ check failure after 40 s) whenever
the timeout is shorter, and instead of the silence of a gloo or NCCL collective that waits
for ever.

Two timeouts: a program (name, options, input shapes) that has not completed yet in this
process gets ``first_timeout`` (its peers may still be compiling it, or restoring a
checkpoint); once one call of it has completed, its later calls get ``timeout``.

A failure on one device does not wait for either. When one device's part of a program fails
at run time (a host callback that raises, say, on a pipeline's last stage), that device's
share of the outputs is ready at once, carrying the error, while the other devices wait for
it in their next collective, for ever, or until XLA:CPU's rendezvous timeout aborts the
process (60 s by default, with no Python error). Once the oldest entry has been pending for
:data:`FAILED_CHECK_S`, the thread looks at its output's shards on this process's devices:
when one holds an error, it prints one line naming the program, the device, its position in
the mesh (the pipeline stage) and the error, and ends the process (exit code 1), about a
second after the failure: whenever calls are watched at all (a timeout is set, as by default,
or the process is in a multi-process job), however long the timeouts.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import threading
import time
from typing import Any

import jax

from .._jax import ArrayImpl as _ArrayImpl  # None if JAX moved it: flatten every time
from . import process, recorder

POLL_S = 0.25
LEFT_GRACE_S = 1.5  # how long an entry may stay pending once a process it needs has exited
FAILED_CHECK_S = 0.5
"""How long the oldest entry stays pending before the thread looks for a device whose share of
it failed (and then at every poll, each device's share read once it is ready): a program that
completes sooner is never looked at."""

_pending: collections.deque = collections.deque()
_thread: threading.Thread | None = None


def register(outputs: Any, what: Any, inputs: Any = None, options: str = "") -> None:
    """Watch ``outputs`` (a pytree of ``jax.Array``) of the program ``what`` just dispatched,
    and record the call in the flight recorder.

    Never blocks. ``inputs`` (optional) serves the messages and the record: their shapes are
    kept. ``options`` (the op's options, e.g. ``"src=0"``) goes into the record.
    """
    if not process.settings.configured:
        configure()
    if not process.settings.on:
        return
    leaf = _first_leaf(outputs)
    call = recorder.record(leaf, what, outputs if inputs is None else inputs, options)
    _pending.append([call, leaf, (what, options, call.sig)])


DISPATCHING = object()
"""The outputs of a call whose dispatch has not returned yet (see :func:`run`)."""


def run(program: Any, x: Any, what: str, options: str = "") -> Any:
    """``program(x)``, watched from before its dispatch: record the call and put it under the
    watchdog, dispatch, then watch its outputs; return them.

    For programs whose dispatch itself can block: XLA:CPU's dispatch waits once too many
    programs are queued, or while an earlier one holds the devices, and a call registered
    only after its dispatch returned would then hang unwatched. ``x`` (a pytree of
    ``jax.Array`` on the call's devices) gives the record its shapes and its processes.
    """
    if not process.settings.configured:
        configure()
    if not process.settings.on:
        return program(x)
    call = recorder.record(_first_leaf(x), what, x, options)
    entry = [call, DISPATCHING, (what, options, call.sig)]
    _pending.append(entry)
    try:
        out = program(x)
    except BaseException:
        entry[1] = None  # raised before running anything: nothing to wait for
        raise
    entry[1] = _first_leaf(out)
    return out


_completed: set[Any] = set()  # (what, options, signature) of programs that completed here
_resumed_at = 0.0  # calls issued before this (monotonic) were registered before a pause


def pause() -> process.Settings:
    """Turn this process's collective watchdog and flight recorder off, from now until
    :func:`resume`; return the settings in force before (to pass to :func:`resume`).

    For code that expects some of a program's devices to fail while the others still wait
    (``dp.Survivor``, where a lost peer fails a step on some devices first): the watchdog's
    failed-device check would end the process. Calls made while paused are not watched or
    recorded; a collective that hangs then waits for XLA's own timeout. Mismatch detection
    and the monitor of failed peers (:mod:`.monitor`) are unchanged.

    Returns:
        The :class:`process.Settings` in force before the pause.
    """
    with process.lock:
        before = process.settings
        process.settings = dataclasses.replace(before, on=False, watching=False, configured=True)
    return before


def resume(before: process.Settings) -> None:
    """Undo :func:`pause`: restore ``before`` (its return value). The calls registered
    before the pause are no longer watched (their outputs may have failed while paused);
    calls made from now on are."""
    global _resumed_at
    if not isinstance(before, process.Settings):
        raise TypeError(
            f"resume: before must be the Settings that pause() returned, got {before!r} of "
            f"type {type(before).__name__} instead."
        )
    with process.lock:
        _resumed_at = time.monotonic()
        process.settings = before
    ensure_thread()


def watch_outputs(outputs: Any, what: str) -> Any:
    """Put ``outputs`` of a dispatched program under the watchdog; return them unchanged.

    The hook for a loop that runs its own jitted step (``dp.Trainer`` registers each step's
    outputs): if they are not computed within the collective timeout, the process ends with
    one line naming ``what``, their shapes and how long it waited. Costs about a microsecond
    and never waits; does nothing while the watchdog is off. It does not check that the
    processes agree (that needs the program and its inputs before the call): use
    :func:`jaxcoll.watch` for that.

    Note:
        The watchdog keeps a reference to ``outputs`` until it has seen them finish (at most
        0.25 s later). All outputs of one program finish together, so passing one small output
        (the loss) is enough and keeps no large buffer alive; donated buffers are never kept.

    Example (``JAXCOLL_TIMEOUT=60``)::

        >>> state, loss = jaxcoll.watch_outputs(step(state, batch), "train step 12")
    """
    register(outputs, what)
    return outputs


def configure(
    timeout: float | str | None = "env",
    debug: str | None = "env",
    first_timeout: float | str | None = "env",
    api: str = "init",
) -> None:
    """Settle the timeouts and detail mode (:func:`process.configure`; ``"env"``: from the
    environment), have a process that ends early write its flight record, and start the
    thread if it has work."""
    process.configure(timeout, debug, api=api, first_timeout_s=first_timeout)
    process.on_leave = recorder.dump_on_leave
    ensure_thread()


def ensure_thread() -> None:
    """Start the watchdog thread if it watches or records (:data:`process.settings.on`) and is not
    running."""
    global _thread, _stop_hook
    if not process.settings.on:
        return
    with process.lock:
        if _thread is None or not _thread.is_alive():
            _stopping.clear()
            _thread = threading.Thread(target=_run, name="jaxcoll-watchdog", daemon=True)
            _thread.start()
            if not _stop_hook:
                atexit.register(stop)
                _stop_hook = True


_stopping = threading.Event()
_stop_hook = False


def stop() -> None:
    """End the thread and drop the outputs it watches (at interpreter exit, registered by
    :func:`ensure_thread`).

    A daemon thread that still holds ``jax.Array`` objects when the interpreter finalizes
    drops them there, and jaxlib's destructor then ends the process with ``std::terminate``
    (SIGABRT at exit, after a run that succeeded). So the thread ends first, and the deque
    is emptied while JAX is whole. Runs after :func:`jaxcoll._watch._at_exit` (registered
    later), whose wait for the outputs needs the thread.
    """
    _stopping.set()
    thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(2 * POLL_S + 1.0)
    _pending.clear()


EXIT_WAIT_S = 10.0
"""At a normal exit with the watchdog off, the longest :func:`drain` waits for the programs
still running, so that the flight record says they completed."""


def drain(wait_s: float) -> None:
    """At a normal exit: wait (at most ``wait_s``; :data:`EXIT_WAIT_S` with the watchdog off)
    until every registered program has finished, stamping each completion in the flight
    record here rather than leaving it to the thread's next poll, so that a record written
    now never shows a finished call as unfinished (it would read as a stall)."""
    deadline = time.monotonic() + (wait_s if process.settings.watching else EXIT_WAIT_S)
    while True:
        unfinished = False
        for call, leaf, _ in list(_pending):  # the thread pops them; only stamp here
            if call.done is None:
                if _done(leaf):
                    call.done = time.monotonic()
                else:
                    unfinished = True
        if not unfinished or time.monotonic() >= deadline:
            return
        time.sleep(0.05)  # the thread fires on what is stuck


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
    if leaf is DISPATCHING:
        return False
    try:
        if leaf.is_deleted():  # is_ready() of a deleted array can crash the process
            return True
        return bool(leaf.is_ready())
    except Exception:  # noqa: BLE001 - donated or otherwise gone: not ours to wait for
        return True


def _run() -> None:
    head: Any = None
    since = 0.0
    left_seen_at: float | None = None
    next_probe = 0.0
    checked: set[int] = set()
    while not _stopping.wait(POLL_S):
        if not process.settings.on:
            continue
        while _pending:
            item = _pending[0]
            if item[0].issued < _resumed_at:  # registered before a pause: not watched
                _pending.popleft()
                head = None
                continue
            if item is not head:  # a new oldest entry: its wait starts now (or at dispatch)
                head, left_seen_at = item, None
                checked = set()  # its shards found healthy so far (see failed_device)
                since = max(item[0].issued, time.monotonic() - POLL_S)
                # Its timeout: the short one once a call of the same program (name, options,
                # input shapes) has completed here. Calls complete in order, so every call
                # before this one has been seen by now.
                item[0].first = item[2] not in _completed
                cfg = process.settings
                item[0].limit = cfg.first_timeout if item[0].first else cfg.timeout
            if not _done(item[1]):  # read each time: run() sets it once dispatched
                break
            _pending.popleft()
            if item[0].done is None:  # drain may have stamped it first
                item[0].done = time.monotonic()
            _completed.add(item[2])
            head = None
        if head is None:
            continue
        now = time.monotonic()
        waited = now - since
        if waited >= FAILED_CHECK_S:
            failed = failed_device(head[1], checked)
            if failed is not None:
                _fire_failed(head[0], head[1], waited, *failed)
        if not process.settings.watching:
            continue
        t = head[0].limit
        if waited >= min(1.0, t or 1.0) and now >= next_probe and process.client() is not None:
            next_probe = now + 1.0
            if left_seen_at is None and set(process.exited()) & set(head[0].group):
                left_seen_at = now
        if (t is not None and waited >= t) or (
            left_seen_at is not None and now - left_seen_at >= LEFT_GRACE_S
        ):
            _fire(head[0], waited, t)


def _fire(call: recorder.Call, waited: float, t: float | None) -> None:
    me, n = process.me()
    desc = f"{call.what}({recorder.describe(call.sig)})"
    procs = call.group
    where = f" over processes {process.ranges(procs)}" if n > 1 and procs else ""
    process.kv(lambda c: c.key_value_set(f"{process.PREFIX}stuck/{me}", desc, allow_overwrite=True))
    gone = [p for p in process.exited() if p != me and p in procs]
    stuck = process.kv(lambda c: c.key_value_dir_get(f"{process.PREFIX}stuck/")) or []
    others = []
    if gone:
        others.append(
            f"process(es) {process.ranges(gone)} exited while this one waits for "
            f"it (they never joined it, or joined with other shapes)"
        )
    for key, value in sorted(stuck):
        p = int(key.rsplit("/", 1)[1])
        if p != me and p not in gone:
            others.append(f"process {p} timed out in {value}")
    if not others and n > 1:
        others.append(
            "the other processes have not joined it (they are in another "
            "collective, or outside any)"
        )
    first = call.first and process.settings.first_timeout != process.settings.timeout
    kind = "first-call timeout" if first else "timeout"
    verb = (
        f"timed out after {waited:.1f}s ({kind} {t:g}s)"
        if t is not None and waited >= t
        else f"gave up after {waited:.1f}s"
    )
    site = f" at {os.path.basename(call.file)}:{call.line}" if call.file != "?" else ""
    process.die(
        f"jaxcoll: process {me} of {n} {verb} waiting for {desc}{where} (call "
        f"#{call.group_seq}{site}): {'; '.join(others) or 'it never finished'}; exiting "
        f"with code 1.",
        1,
    )


def failed_device(leaf: Any, checked: set[int]) -> tuple[Any, str] | None:
    """``(device, error)`` of a shard of ``leaf`` on this process's devices that is ready with
    an error while the others are not; None if there is none (yet).

    ``checked`` holds the ids of the devices whose shards were found ready without an error
    (each is read once). A shard that is ready and healthy returns at once; one that failed
    raises its error at once, so this never waits.
    """
    if leaf is None or leaf is DISPATCHING:
        return None
    try:
        if leaf.is_deleted():
            return None
        shards = leaf.addressable_shards
    except Exception:  # noqa: BLE001 - gone or not an array: nothing to look at
        return None
    if len(shards) < 2:
        return None  # one device: its error reaches whoever waits for it
    for shard in shards:
        device = shard.device
        if device.id in checked:
            continue
        try:
            if not shard.data.is_ready():
                continue
            shard.data.block_until_ready()
        except Exception as e:  # noqa: BLE001 - the device's error, whatever its type
            return device, _error_line(e)
        checked.add(device.id)
    return None


def _error_line(e: BaseException) -> str:
    """The line of a device's error that names its cause: the last ``Name: text`` line of a
    callback's traceback, or the error's first line."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    causes = [line for line in lines if ": " in line and line.split(": ", 1)[0].isidentifier()]
    first = lines[0] if lines else type(e).__name__
    cause = causes[-1] if causes else first
    return cause[:500] if cause == first else f"{cause[:400]} ({first[:100]})"


def _position(leaf: Any, device: Any) -> str:
    """``device``'s position in the mesh of ``leaf``'s sharding (``stage=1, data=0``), or ""."""
    mesh: Any = getattr(getattr(leaf, "sharding", None), "mesh", None)
    devices = getattr(mesh, "devices", None)
    if mesh is None or devices is None:
        return ""
    for index, d in enumerate(devices.flat):
        if d == device:
            coords = _coords(index, devices.shape)
            return ", ".join(f"{n}={c}" for n, c in zip(mesh.axis_names, coords, strict=True))
    return ""


def _coords(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The coordinates of flat ``index`` in an array of ``shape`` (row-major)."""
    coords = []
    for size in reversed(shape):
        index, c = divmod(index, size)
        coords.append(c)
    return tuple(reversed(coords))


def _fire_failed(call: recorder.Call, leaf: Any, waited: float, device: Any, error: str) -> None:
    me, n = process.me()
    desc = f"{call.what}({recorder.describe(call.sig)})"
    where = _position(leaf, device)
    site = f" at {os.path.basename(call.file)}:{call.line}" if call.file != "?" else ""
    process.die(
        f"jaxcoll: process {me} of {n}: {desc} (call #{call.group_seq}{site}) failed on "
        f"device {device.id}{f' (mesh position {where})' if where else ''}: {error}; the "
        f"other devices wait for it in a collective; exiting with code 1 after "
        f"{waited:.1f}s.",
        1,
    )
