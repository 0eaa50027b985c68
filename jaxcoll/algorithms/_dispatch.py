"""How the primitives hand a call to an algorithm (``algorithm=`` other than ``"native"``).

Each entry point returns None when the call should take the primitive's own native path, so
``algorithm="native"`` (and ``"auto"`` where the table says native) is exactly the primitive's
lowering, op for op.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._ops import ReduceOp
from ..primitives._axis import Axis
from . import hierarchical, ring, tree
from .auto import ALGORITHMS, choose_for

_MODULES = {"ring": ring, "tree": tree, "hierarchical": hierarchical}


def check_algorithm(api: str, algorithm: Any, argname: str = "algorithm") -> str:
    """``algorithm`` (passed as ``argname``) must be one of :data:`ALGORITHMS` (a string)."""
    if not isinstance(algorithm, str):
        raise TypeError(f"{api}: {argname} must be a string, one of {', '.join(ALGORITHMS)}; "
                        f"got {algorithm!r} of type {type(algorithm).__name__} instead.")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{api}: {argname}={algorithm!r} is not one of "
                         f"{', '.join(ALGORITHMS)}. Pass one of them (\"auto\" picks from the "
                         f"measured table).")
    return algorithm


def _resolve(api: str, op_key: str, algorithm: str, ax: Axis, nbytes: int) -> str:
    algorithm = check_algorithm(api, algorithm)
    if algorithm == "auto":
        return choose_for(op_key, nbytes, ax)
    return algorithm


def _nbytes(leaves: list[jax.Array]) -> int:
    return sum(int(leaf.size) * np.dtype(leaf.dtype).itemsize for leaf in leaves)


def _groups(leaves: list[jax.Array]) -> list[list[int]]:
    """Indices of the leaves, grouped by dtype (each group becomes one flat buffer)."""
    by_dtype: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(np.dtype(leaf.dtype), []).append(i)
    return list(by_dtype.values())


def _bucketed(leaves: list[jax.Array], idx: list[int], fn) -> list[jax.Array]:
    """Run ``fn`` once on the leaves ``idx`` raveled into one buffer; split the result."""
    if len(idx) == 1:
        return [fn(leaves[idx[0]])]
    flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in idx])
    out = fn(flat)
    res, start = [], 0
    for i in idx:
        size = leaves[i].size
        res.append(out[start:start + size].reshape(leaves[i].shape))
        start += size
    return res


def _run_grouped(api, op_key, algorithm, leaves, ax, per_group, native_leaf):
    """Shared driver: resolve per dtype group; None when every group goes native."""
    groups = _groups(leaves)
    chosen = [_resolve(api, op_key, algorithm, ax, _nbytes([leaves[i] for i in g]))
              for g in groups]
    if all(c == "native" for c in chosen):
        return None
    out: list[Any] = [None] * len(leaves)
    for g, algo in zip(groups, chosen):
        if algo == "native":
            for i in g:
                out[i] = native_leaf(i)
            continue
        kind_of = g[0]
        res = _bucketed(leaves, g, lambda flat, a=algo, k=kind_of: per_group(_MODULES[a], flat, k))
        for i, r in zip(g, res):
            out[i] = r
    return out


def all_reduce(api: str, algorithm: Any, leaves, kinds, ax: Axis, op: ReduceOp):
    """All-reduce ``leaves`` with ``algorithm``; None means: use the native path."""
    from ..primitives.all_reduce import all_reduce_leaf

    return _run_grouped(
        api, "all_reduce", algorithm, leaves, ax,
        lambda mod, flat, i: mod.all_reduce(flat, ax, op, kinds[i]),
        lambda i: all_reduce_leaf(leaves[i], ax, op, kinds[i]),
    )


def reduce(api: str, algorithm: Any, leaves, kinds, ax: Axis, dst: int, op: ReduceOp):
    """Reduce ``leaves`` to ``dst`` with ``algorithm``; None means: use the native path."""
    from ..primitives.all_reduce import reduce_leaf

    return _run_grouped(
        api, "reduce", algorithm, leaves, ax,
        lambda mod, flat, i: mod.reduce(flat, ax, dst, op, kinds[i]),
        lambda i: reduce_leaf(leaves[i], ax, dst, op, kinds[i]),
    )


def broadcast(api: str, algorithm: Any, leaves, ax: Axis, src: int):
    """Broadcast ``leaves`` from ``src`` with ``algorithm``; None means: use the native path."""
    from ..primitives._lowering import native_broadcast

    return _run_grouped(
        api, "broadcast", algorithm, leaves, ax,
        lambda mod, flat, i: mod.broadcast(flat, ax, src),
        lambda i: native_broadcast(leaves[i], ax, src),
    )


def all_gather_leaf(api: str, algorithm: Any, x: jax.Array, ax: Axis, axis: int, tiled: bool):
    """All-gather one leaf (axis already checked); None means: use the native path.

    The algorithm returns the parts stacked on a new leading axis; this places them like
    ``lax.all_gather(x, axis=axis, tiled=tiled)``.
    """
    algo = _resolve(api, "all_gather", algorithm, ax, _nbytes([x]))
    if algo == "native":
        return None
    stacked = _MODULES[algo].all_gather(x, ax)
    out = jnp.moveaxis(stacked, 0, axis)
    if tiled:
        shape = x.shape[:axis] + (ax.size * x.shape[axis],) + x.shape[axis + 1:]
        out = out.reshape(shape)
    return out


def reduce_scatter_parts(api: str, algorithm: Any, parts: jax.Array, ax: Axis, op: ReduceOp,
                         kind: str):
    """``parts`` is ``(n, *s)``: rank r gets part r reduced; None means: use the native path."""
    algo = _resolve(api, "reduce_scatter", algorithm, ax, _nbytes([parts]))
    if algo == "native":
        return None
    rows = parts.reshape(ax.size, -1)
    out = _MODULES[algo].reduce_scatter_rows(rows, ax, op, kind)
    return out.reshape(parts.shape[1:])
