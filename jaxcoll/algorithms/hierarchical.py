"""Hierarchical algorithms over a 2-D group ``(outer, inner)``, e.g. ``('node', 'local')``.

The inner axis is the fast one (devices of one process or one NVLink island), the outer axis
the slow one (gloo/TCP or the network between hosts). Each algorithm keeps most bytes on
the inner axis and sends only ``1/inner`` of the data across the outer one:

* all-reduce: reduce-scatter inside each inner group, all-reduce of that ``1/inner`` slice
  across the outer groups, all-gather inside the inner group;
* reduce-scatter: reduce-scatter inside, then reduce-scatter of the ``1/inner`` result across;
* all-gather: all-gather across (each rank's own part only), then inside;
* broadcast: broadcast inside the source's inner groups, each inner rank broadcasts its
  ``1/inner`` slice across, all-gather inside;
* reduce: the hierarchical all-reduce, kept on ``dst``.

Each phase is the primitive's native lowering on its sub-axis (``psum_scatter``, ``psum``,
``all_gather``; ``all_to_all`` + a local fold for ops lax has no collective for). Ranks are
row-major over the tuple: rank = outer_rank * inner_size + inner_rank, as everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._ops import ReduceOp
from ..primitives._axis import Axis
from ..primitives._lowering import (
    ensure_varying,
    is_rank,
    native_broadcast,
    reduce_scatter_leading,
)
from ..primitives.all_reduce import all_reduce_leaf
from ._common import finish_avg, from_rows, sub_axes, to_rows


def _rs_leading(rows: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """Reduce-scatter along the leading axis (size ax.size), no AVG division."""
    if ax.size == 1:
        return rows[0]
    if kind != "bool" and op in (ReduceOp.SUM, ReduceOp.AVG):
        return lax.psum_scatter(rows, ax.name, scatter_dimension=0, tiled=False)
    return reduce_scatter_leading(rows, ax, op, kind)


def _fold_op(op: ReduceOp) -> ReduceOp:
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def all_reduce(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """Reduce-scatter inside, all-reduce ``1/inner`` across, all-gather inside."""
    outer, inner = sub_axes("all_reduce", ax, "hierarchical")
    x = ensure_varying(x, ax)
    part = _rs_leading(to_rows(x, inner.size), inner, _fold_op(op), kind)
    if outer.size > 1:
        part = all_reduce_leaf(part, outer, _fold_op(op), kind)
    part = finish_avg(part, op, ax.size)
    full = lax.all_gather(part, inner.name, axis=0, tiled=False) if inner.size > 1 else part[None]
    return from_rows(full, x)


def reduce_scatter_rows(rows: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """``rows`` is ``(n, m)``; rank r = (o, i) gets row r. Inside first, then across."""
    outer, inner = sub_axes("reduce_scatter", ax, "hierarchical")
    rows = ensure_varying(rows, ax)
    m = rows.shape[1]
    # Row o * inner + i goes to inner rank i of outer group o: put the inner index first.
    by_inner = rows.reshape(outer.size, inner.size, m).transpose(1, 0, 2)
    mine = _rs_leading(by_inner, inner, _fold_op(op), kind)  # (outer, m), rows {o' * ni + i}
    mine = _rs_leading(mine, outer, _fold_op(op), kind)  # (m,), row o * ni + i
    return finish_avg(mine, op, ax.size)


def all_gather(x: jax.Array, ax: Axis) -> jax.Array:
    """All-gather across (own part only), then inside: ``(n, *x.shape)`` in rank order."""
    outer, inner = sub_axes("all_gather", ax, "hierarchical")
    x = ensure_varying(x, ax)
    g = lax.all_gather(x, outer.name, axis=0, tiled=False) if outer.size > 1 else x[None]
    g = lax.all_gather(g, inner.name, axis=0, tiled=False) if inner.size > 1 else g[None]
    # g is (inner, outer, ...): rank o * ni + i is g[i, o].
    return jnp.swapaxes(g, 0, 1).reshape((ax.size,) + x.shape)


def broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    """Inside the source's groups, then ``1/inner`` slices across, then all-gather inside."""
    outer, inner = sub_axes("broadcast", ax, "hierarchical")
    so, si = divmod(src, inner.size)
    x = ensure_varying(x, ax)
    if inner.size > 1:
        x = native_broadcast(x, inner, si)
    if outer.size == 1:
        return x
    rows = to_rows(x, inner.size)
    mine = lax.dynamic_index_in_dim(rows, inner.rank(), keepdims=False)
    mine = native_broadcast(mine, outer, so)
    full = lax.all_gather(mine, inner.name, axis=0, tiled=False) if inner.size > 1 else mine[None]
    return from_rows(full, x)


def reduce(x: jax.Array, ax: Axis, dst: int, op: ReduceOp, kind: str) -> jax.Array:
    """The hierarchical all-reduce, kept on ``dst``; other ranks keep their ``x``."""
    return jnp.where(is_rank(ax, dst), all_reduce(x, ax, op, kind), x)
