"""Ring algorithms: bandwidth-optimal, 2(n-1) (all-reduce) or n-1 ``ppermute`` steps.

Each rank only ever talks to its right neighbour (rank + 1 mod n), in chunks of 1/n of the
data, so each rank sends ``2(n-1)/n`` of the buffer for an all-reduce: the least any algorithm
can. What makes it fast (each change measured in ``docs/benchmarks.md``):

* the reduce-scatter carries a running partial sum from step to step (``acc = recv + chunk``),
  so the add fuses with reading the local chunk and no buffer is updated in place;
* the chunks are contiguous rows of one ``(n, m)`` view of the flattened input;
* the all-gather writes each received chunk once into the output (an in-place
  dynamic-update-slice), instead of stacking the chunks and rotating them afterwards, which
  costs a full extra pass over the buffer on CPU.

Functions here work on one validated leaf and an :class:`~jaxcoll.primitives._axis.Axis`;
the public entry points are the primitives with ``algorithm="ring"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._ops import ReduceOp, combine_fn
from ..primitives._axis import Axis
from ..primitives._lowering import ensure_varying, is_rank
from ._common import finish_avg, from_rows, ring_perm, to_bits, to_rows


def reduce_scatter_rows(rows: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """``rows`` has shape ``(n, m)``; rank r gets row r folded over all ranks, shape ``(m,)``.

    n-1 steps. In step s rank r sends its partial sum of row (r - 1 - s) to rank r + 1 and
    adds its own row (r - 2 - s) to the partial it receives; after n-1 steps the partial is
    row r, summed over all n ranks. AVG is divided by n at the end.
    """
    n = ax.size
    if n == 1:
        return finish_avg(rows[0], op, 1)
    fn = combine_fn(op, kind)
    rows = ensure_varying(rows, ax)
    r = ax.rank()
    acc = lax.dynamic_index_in_dim(rows, (r - 1) % n, keepdims=False)
    right = ring_perm(n)
    for s in range(n - 1):
        recv = lax.ppermute(acc, ax.name, right)
        mine = lax.dynamic_index_in_dim(rows, (r - 2 - s) % n, keepdims=False)
        acc = fn(recv, mine)
    return finish_avg(acc, op, n)


def all_gather_rows(part: jax.Array, ax: Axis) -> jax.Array:
    """Rank r holds ``part`` of shape ``(m,)``; every rank gets all parts as ``(n, m)``.

    n-1 steps: each rank forwards the part it received last to its right neighbour and writes
    it in place at its row.
    """
    n = ax.size
    part = ensure_varying(part, ax)
    if n == 1:
        return part[None]
    r = ax.rank()
    out = jnp.zeros((n,) + part.shape, part.dtype)
    out = lax.dynamic_update_index_in_dim(out, part, r, 0)
    right = ring_perm(n)
    cur = part
    for s in range(n - 1):
        cur = lax.ppermute(cur, ax.name, right)  # the part of rank r - 1 - s
        out = lax.dynamic_update_index_in_dim(out, cur, (r - 1 - s) % n, 0)
    return out


def all_reduce(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """Ring all-reduce: reduce-scatter then all-gather, 2(n-1) steps, padded to n rows."""
    if ax.size == 1:
        return x
    part = reduce_scatter_rows(to_rows(x, ax.size), ax, op, kind)
    return from_rows(all_gather_rows(part, ax), x)


def all_gather(x: jax.Array, ax: Axis) -> jax.Array:
    """Ring all-gather of a whole leaf: returns ``(n, *x.shape)`` in rank order."""
    out = all_gather_rows(jnp.ravel(x), ax)
    return out.reshape((ax.size,) + x.shape)


def _broadcast_bits(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    bits, back = to_bits(x)
    bits = jnp.where(is_rank(ax, src), bits, jnp.zeros_like(bits))
    kind = "bool" if bits.dtype == jnp.bool_ else "integer"
    return back(all_reduce(bits, ax, ReduceOp.BOR, kind)).reshape(x.shape)


def broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    """Ring broadcast: a ring all-reduce with bitwise OR of src's bits and everyone's zeros.

    Bit-exact for every dtype (the bits are only OR-ed with zeros) and bandwidth-optimal like
    van de Geijn's scatter + all-gather broadcast: each rank sends 2(n-1)/n of the buffer.
    Bit casts have no derivative, so for float and complex data the gradient is given
    directly: the transpose of a broadcast is a SUM reduce of the cotangents onto ``src``.
    """
    if ax.size == 1:
        return x
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return _broadcast_bits(x, ax, src)

    @jax.custom_vjp
    def bcast(v):
        return _broadcast_bits(v, ax, src)

    def fwd(v):
        return bcast(v), None

    def bwd(_, ct):
        total = all_reduce(ct, ax, ReduceOp.SUM, "floating")
        return (jnp.where(is_rank(ax, src), total, jnp.zeros_like(total)),)

    bcast.defvjp(fwd, bwd)
    return bcast(x)


def reduce(x: jax.Array, ax: Axis, dst: int, op: ReduceOp, kind: str) -> jax.Array:
    """Ring reduce: the ring all-reduce, kept on ``dst`` (a rooted ring saves no steps)."""
    return jnp.where(is_rank(ax, dst), all_reduce(x, ax, op, kind), x)
