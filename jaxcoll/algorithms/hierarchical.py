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
``all_gather``; ``all_to_all`` + a local fold for ops lax has no collective for). The
all-reduce, all-gather and broadcast end in native collectives typed invariant, so their
results are typed invariant over both axes. Ranks are
row-major over the tuple: rank = outer_rank * inner_size + inner_rank, as everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._core import lowering
from .._core.axis import Axis, is_rank
from .._core.ops import ReduceOp, finish_avg
from .._core.packing import from_rows, to_rows
from .._core.vma import ensure_varying
from ._shapes import leaf_ops

PACKS = True  # leaves of one dtype travel as one buffer


def sub_axes(api: str, ax: Axis) -> tuple[Axis, Axis]:
    """Split a tuple axis into (outer, inner): inner is the last name, outer the rest.

    Ranks are numbered row-major over the tuple, so rank = outer_rank * inner_size + inner_rank.
    """
    if not isinstance(ax.name, tuple):
        raise ValueError(
            f"{api}: algorithm='hierarchical' needs a 2-D group, a tuple axis_name like "
            f"('node', 'local') (outer, inner), got axis_name={ax.name!r}. Build the mesh with "
            f"two axes, e.g. jax.make_mesh((2, 4), ('node', 'local')), or pick another algorithm."
        )
    # Sub-axis names stay tuples: some lax collectives (pbroadcast) iterate a plain name.
    outer_name, inner_name = ax.name[:-1], ax.name[-1:]
    outer = Axis(outer_name, int(lax.axis_size(outer_name)))
    inner = Axis(inner_name, int(lax.axis_size(inner_name)))
    return outer, inner


def _sum_op(op: ReduceOp) -> ReduceOp:
    """AVG is summed through both levels and divided once at the end."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def _rs_leading(rows: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """Reduce-scatter along the leading axis (size ax.size), no AVG division."""
    return lowering.reduce_scatter(rows, ax, _sum_op(op), kind, 0, False)


def all_reduce(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """Reduce-scatter inside, all-reduce ``1/inner`` across, all-gather inside."""
    outer, inner = sub_axes("all_reduce", ax)
    x = ensure_varying(x, ax)
    part = _rs_leading(to_rows(x, inner.size), inner, op, kind)
    if outer.size > 1:
        part = lowering.all_reduce(part, outer, _sum_op(op), kind)
    part = finish_avg(part, op, ax.size)
    return from_rows(lowering.all_gather(part, inner, 0, False), x)


def reduce_scatter_rows(rows: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """``rows`` is ``(n, m)``; rank r = (o, i) gets row r. Inside first, then across."""
    outer, inner = sub_axes("reduce_scatter", ax)
    rows = ensure_varying(rows, ax)
    m = rows.shape[1]
    # Row o * inner + i goes to inner rank i of outer group o: put the inner index first.
    by_inner = rows.reshape(outer.size, inner.size, m).transpose(1, 0, 2)
    mine = _rs_leading(by_inner, inner, op, kind)  # (outer, m), rows {o' * ni + i}
    mine = _rs_leading(mine, outer, op, kind)  # (m,), row o * ni + i
    return finish_avg(mine, op, ax.size)


def _stacked(x: jax.Array, ax: Axis) -> jax.Array:
    """All-gather across (own part only), then inside: ``(n, *x.shape)`` in rank order."""
    outer, inner = sub_axes("all_gather", ax)
    x = ensure_varying(x, ax)
    g = lowering.all_gather(x, outer, 0, False)
    g = lowering.all_gather(g, inner, 0, False)
    # g is (inner, outer, ...): rank o * ni + i is g[i, o].
    return jnp.swapaxes(g, 0, 1).reshape((ax.size,) + x.shape)


# Hierarchical all-gather and reduce-scatter of a whole leaf, placed like lax.all_gather and
# lax.psum_scatter.
all_gather, reduce_scatter = leaf_ops(_stacked, reduce_scatter_rows)


def broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    """Inside the source's groups, then ``1/inner`` slices across, then all-gather inside."""
    outer, inner = sub_axes("broadcast", ax)
    so, si = divmod(src, inner.size)
    x = lowering.broadcast(ensure_varying(x, ax), inner, si)
    if outer.size == 1:
        return x
    rows = to_rows(x, inner.size)
    mine = lax.dynamic_index_in_dim(rows, inner.rank(), keepdims=False)
    mine = lowering.broadcast(mine, outer, so)
    return from_rows(lowering.all_gather(mine, inner, 0, False), x)


def reduce(x: jax.Array, ax: Axis, dst: int, op: ReduceOp, kind: str) -> jax.Array:
    """The hierarchical all-reduce, kept on ``dst``; other ranks keep their ``x``."""
    return jnp.where(is_rank(ax, dst), all_reduce(x, ax, op, kind), x)
