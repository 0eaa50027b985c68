"""Mismatch detection (``JAXCOLL_DEBUG=detail``): processes must run the same collectives.

When ranks disagree (one process all-reduces while another all-gathers, broadcasts from
another source, or passes int32 where the other passes float32), gloo and NCCL hang or return
garbage without a word. Before a collective program first runs, :func:`agree` publishes its
fingerprint (op, group, shapes, dtypes, options, a hash of the lowered program) in
``jax.distributed``'s key-value store under ``jaxcoll/fp/<processes>/<n>/<process>``, the n-th
fingerprint of this set of processes, reads every other process's n-th, and raises on every
process, naming each one's differing fields, when they differ.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any

import jax

from . import process, watchdog

_seq: dict[str, int] = {}

# The attribute of a raised error that jaxcoll's fail-fast excepthook (jaxcoll._init) calls
# before the process leaves: a rendezvous, so that every process gets to print its error.
_BEFORE_EXIT = "_jaxcoll_before_exit"


def agree(api: str, fields: dict[str, str], processes: tuple[int, ...]) -> None:
    """Check that every process in ``processes`` runs the program described by ``fields``.

    Each process calls it at the same point (a program's first use); the n-th call over a
    given set of processes compares the n-th fingerprints. Raises ``RuntimeError`` on every
    process when they differ, and when a process has not published its fingerprint within the
    collective timeout or exited first.
    """
    client = process.client()
    me, n = process.me()
    if client is None or len(processes) < 2 or me not in processes:
        return
    scope = "-".join(map(str, processes)) if len(processes) < n else "all"
    with process.lock:
        seq = _seq[scope] = _seq.get(scope, 0) + 1
    key = f"{process.PREFIX}fp/{scope}/{seq}/"
    wait = process.collective_timeout(first=True) or process.DEFAULT_FIRST_TIMEOUT

    def missing(p: int, why: str) -> Exception:
        return RuntimeError(
            f"{api}: at collective #{seq} (process {me} runs {_summary(fields, fields)}), "
            f"process {p} {why}. Every process must run the same collectives in the same "
            f"order; detection compares programs at their first use, so process {p} may be "
            f"in a program it has run before."
        )

    entries = process.exchange(key, json.dumps(fields), processes, wait, missing)
    got = {p: json.loads(v) for p, v in entries.items()}
    differ = [
        k
        for k in dict.fromkeys(k for f in got.values() for k in f)
        if len({json.dumps(f.get(k)) for f in got.values()}) > 1
    ]
    if not differ:
        return
    show = [k for k in differ if k != "program"] or differ
    listing = "; ".join(f"process {p}: {_summary(got[p], show)}" for p in sorted(got))
    error = RuntimeError(f"{api}: processes disagree on the collective #{seq}: {listing}")
    # Every process must get to print it: the first to leave ends the job (the others learn
    # of it and leave too). jaxcoll's fail-fast excepthook calls this after printing the
    # traceback, before leaving.
    setattr(error, _BEFORE_EXIT, functools.partial(_meet, f"{key}printed/", processes))
    raise error


def _meet(prefix: str, processes: tuple[int, ...], wait_ms: int = 5000) -> None:
    """Record that this process got here, then wait (bounded) until the others have too.

    The fail-fast hook calls this after printing the error and before :func:`process.leave`,
    which ends the process (and tells the others of it): no process leaves before every one
    has printed its own account of the disagreement.
    """
    client, me = process.client(), process.me()[0]
    if client is None:
        return
    client.key_value_set(f"{prefix}{me}", "1")
    _wait_for_all(client, prefix, processes, me, wait_ms)


def _wait_for_all(
    client: Any, prefix: str, processes: tuple[int, ...], me: int, wait_ms: int
) -> None:
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


def describe_args(tree: Any) -> str:
    """``float32[2,4], int32[]`` for the leaves of ``tree`` (other leaves by their repr)."""
    parts = []
    for leaf in jax.tree_util.tree_leaves(tree):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is not None and dtype is not None:
            parts.append(f"{dtype}[{','.join(map(str, shape))}]")
        else:
            parts.append(repr(leaf)[:40])
    return ", ".join(parts)


def program_hash(lowered_text: str) -> str:
    """A short hash of a lowered program's text (``jax.stages.Lowered.as_text()``)."""
    return hashlib.sha256(lowered_text.encode()).hexdigest()[:12]


def processes_of(tree: Any) -> tuple[int, ...]:
    """The processes owning devices of the ``jax.Array`` leaves of ``tree`` (all if none)."""
    procs: set[int] = set()
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            # jaxlib ships no stub for its Device class, so jax's Device annotation is opaque.
            procs |= {
                d.process_index  # type: ignore[attr-defined]
                for d in leaf.sharding.device_set
            }
    return tuple(sorted(procs)) if procs else tuple(range(process.me()[1]))


def watch(fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """Wrap your own jitted SPMD function so that no call of it can hang the job silently.

    Each call dispatches ``fn`` and registers its outputs with the watchdog (never waiting):
    if they are not computed within the collective timeout (``jaxcoll.init(timeout=...)``,
    ``jaxcoll-run --timeout``, ``JAXCOLL_TIMEOUT``; 600 s until its first completion and 300 s
    after it by default in a multi-process job),
    the process ends with one line naming ``name``, the input shapes and how long it waited.
    With ``JAXCOLL_DEBUG=detail`` the first call per input shapes also compares ``fn``'s
    fingerprint (name, shapes, dtypes and, when ``fn`` has ``.lower``, a hash of the lowered
    program) across the processes that own its inputs, and raises on every process when they
    differ. ``jaxcoll.distributed`` calls do both by themselves.

    Args:
        fn: the function, usually ``jax.jit(jax.shard_map(...))``.
        name: the name messages use (default: ``fn.__name__``).

    Returns:
        A callable with ``fn``'s arguments and results.

    Example (under ``jaxcoll-run --nprocs 2 --timeout 60``)::

        >>> step = jaxcoll.watch(jax.jit(train_step), name="train step")
        >>> state, loss = step(state, batch)   # never waits; a stuck step ends the process
    """
    label = name or getattr(fn, "__name__", None) or type(fn).__name__
    seen: set[Any] = set()

    @functools.wraps(fn)
    def watched(*args: Any, **kwargs: Any) -> Any:
        if process.settings.detail:
            _check_first_call(fn, label, seen, args, kwargs)
        out = fn(*args, **kwargs)
        if process.settings.on:
            watchdog.register(out, label, (args, kwargs))
        return out

    return watched


def _check_first_call(
    fn: Callable[..., Any], label: str, seen: set[Any], args: tuple, kwargs: dict
) -> None:
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    sig = (
        treedef,
        tuple(
            (getattr(x, "shape", None), x.dtype) if hasattr(x, "dtype") else ("static", repr(x))
            for x in leaves
        ),
    )
    if sig in seen:
        return
    procs = processes_of((args, kwargs))
    if process.client() is not None and len(procs) > 1:
        fields = {"call": label, "args": describe_args((args, kwargs))}
        lower = getattr(fn, "lower", None)
        if lower is not None:
            fields["program"] = program_hash(lower(*args, **kwargs).as_text())
        agree(label, fields, procs)
    seen.add(sig)
