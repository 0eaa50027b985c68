"""Ring algorithms: bandwidth-optimal, 2(n-1) (all-reduce) or n-1 ``ppermute`` steps.

Each rank only ever talks to its right neighbour (rank + 1 mod n), in chunks of 1/n of the
data, so each rank sends ``2(n-1)/n`` of the buffer for an all-reduce: the least any algorithm
can. What makes it fast (each change measured in ``docs/benchmarks.md``):

* the reduce-scatter carries a running partial sum from step to step (``acc = recv + chunk``),
  so the add fuses with reading the local chunk and no buffer is updated in place;
* the chunks are contiguous rows of one ``(n, m)`` view of the flattened input;
* the all-reduce's gather phase is one native all-gather, typed invariant (every rank holds
  the same result), so ``shard_map``'s checking holds with ``out_specs=P()``;
* the steps are a rolled loop (``lax.fori_loop``): the program, and its compile time, do not
  grow with the number of ranks;
* the ring all-gather writes each received chunk once into the output (an in-place
  dynamic-update-slice), instead of stacking the chunks and rotating them afterwards.

Functions here work on one validated leaf and an :class:`~jaxcoll._core.axis.Axis`;
the public entry points are the primitives with ``algorithm="ring"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._core import lowering
from .._core.axis import Axis, is_rank
from .._core.ops import ReduceOp, combine_fn, finish_avg
from .._core.packing import from_rows, to_bits, to_rows
from .._core.vma import ensure_varying, replicated
from ._shapes import leaf_ops

PACKS = True  # leaves of one dtype travel as one buffer


def ring_perm(n: int) -> list[tuple[int, int]]:
    """Every rank sends to rank ``+1`` (mod n): one full-cycle ``ppermute``."""
    return [(i, (i + 1) % n) for i in range(n)]


def reduce_scatter_rows(rows: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """``rows`` has shape ``(n, m)``; rank r gets row r folded over all ranks, shape ``(m,)``.

    n-1 steps of a rolled loop. In step s rank r sends its partial sum of row (r - 1 - s) to
    rank r + 1 and adds its own row (r - 2 - s) to the partial it receives; after n-1 steps the
    partial is row r, summed over all n ranks. AVG is divided by n at the end.
    """
    n = ax.size
    if n == 1:
        return finish_avg(rows[0], op, 1)
    fn = combine_fn(op, kind)
    rows = ensure_varying(rows, ax)
    r = ax.rank()
    right = ring_perm(n)

    def step(s, acc):
        recv = lax.ppermute(acc, ax.name, right)
        mine = lax.dynamic_index_in_dim(rows, (r - 2 - s) % n, keepdims=False)
        return fn(recv, mine)

    acc = lax.dynamic_index_in_dim(rows, (r - 1) % n, keepdims=False)
    return finish_avg(lax.fori_loop(0, n - 1, step, acc), op, n)


def all_gather_rows(part: jax.Array, ax: Axis) -> jax.Array:
    """Rank r holds ``part`` of shape ``(m,)``; every rank gets all parts as ``(n, m)``.

    n-1 steps of a rolled loop: each rank forwards the part it received last to its right
    neighbour and writes it in place at its row. Typed invariant (bit-identical copies).
    """
    n = ax.size
    part = ensure_varying(part, ax)
    if n == 1:
        return part[None]
    r = ax.rank()
    right = ring_perm(n)

    def step(s, carry):
        out, cur = carry
        cur = lax.ppermute(cur, ax.name, right)  # the part of rank r - 1 - s
        return lax.dynamic_update_index_in_dim(out, cur, (r - 1 - s) % n, 0), cur

    out = lax.dynamic_update_index_in_dim(
        ensure_varying(jnp.zeros((n,) + part.shape, part.dtype), ax), part, r, 0
    )
    out, _ = lax.fori_loop(0, n - 1, step, (out, part))
    return replicated(out, ax)


def all_reduce(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """Ring reduce-scatter (n-1 steps), then one invariant native all-gather."""
    if ax.size == 1:
        return x
    part = reduce_scatter_rows(to_rows(x, ax.size), ax, op, kind)
    return from_rows(lowering.all_gather(part, ax, 0, False), x)


def _stacked(x: jax.Array, ax: Axis) -> jax.Array:
    return all_gather_rows(jnp.ravel(x), ax).reshape((ax.size,) + x.shape)


# Ring all-gather and ring reduce-scatter of a whole leaf, placed like lax.all_gather and
# lax.psum_scatter.
all_gather, reduce_scatter = leaf_ops(_stacked, reduce_scatter_rows)


def _broadcast_bits(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    bits, back = to_bits(x)
    bits = jnp.where(is_rank(ax, src), bits, jnp.zeros_like(bits))
    kind = "bool" if bits.dtype == jnp.bool_ else "integer"
    return back(all_reduce(bits, ax, ReduceOp.BOR, kind)).reshape(x.shape)


def broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    """Ring broadcast: a ring all-reduce with bitwise OR of src's bits and everyone's zeros.

    Bit-exact for every dtype (the bits are only OR-ed with zeros) and bandwidth-optimal like
    van de Geijn's scatter + all-gather broadcast: each rank sends 2(n-1)/n of the buffer.
    Typed invariant. Bit casts have no derivative, so for float and complex data the tangent
    is carried by the binomial ppermute tree instead (the same linear map).
    """
    if ax.size == 1:
        return x
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return _broadcast_bits(x, ax, src)

    if ax.vmapped:
        # Under jax.vmap nothing travels, and jax (0.10) traces a custom JVP rule under jit
        # outside the vmap axis: take the tree, which gives the same bits and is differentiable.
        return replicated(lowering.tree_broadcast(x, ax, src), ax)

    @jax.custom_jvp
    def bcast(v):
        return _broadcast_bits(v, ax, src)

    @bcast.defjvp
    def _jvp(primals, tangents):
        # The tangent takes the (linear, transposable) ppermute tree: reverse mode gives src
        # the cotangent.
        (v,), (t,) = primals, tangents
        return bcast(v), replicated(lowering.tree_broadcast(t, ax, src), ax)

    return bcast(ensure_varying(x, ax))


def reduce(x: jax.Array, ax: Axis, dst: int, op: ReduceOp, kind: str) -> jax.Array:
    """Ring reduce: the ring all-reduce, kept on ``dst`` (a rooted ring saves no steps)."""
    return jnp.where(is_rank(ax, dst), all_reduce(x, ax, op, kind), x)
