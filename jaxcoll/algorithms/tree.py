"""Tree algorithms: latency-optimal, about log2(n) ``ppermute`` steps, any n.

* all-reduce: recursive doubling. In step k every rank swaps its whole buffer with rank
  ``r XOR 2**k`` and both fold ``lower op higher``, so all ranks compute the same tree and get
  bit-identical results. For n not a power of two, the ``e = n - p`` ranks above the largest
  power of two ``p`` first fold into ranks ``0..e-1`` and get the result back at the end
  (log2(p) + 2 steps).
* reduce: binomial tree towards ``dst`` (ceil(log2 n) steps, halving the senders each step).
* broadcast: binomial tree from ``src`` (the primitive's CPU lowering).
* all-gather: Bruck's algorithm, ceil(log2 n) steps for any n: in step k each rank sends the
  ``min(2**k, n - 2**k)`` parts it holds to rank ``r - 2**k``.
* reduce-scatter: the recursive-doubling all-reduce, keeping row r (latency first: it sends
  the whole buffer log2(n) times, which only pays for small messages).

The all-reduce, broadcast and all-gather leave every rank the same bits, so their results are
typed invariant (:func:`jaxcoll._core.vma.replicated`, no op in the program) although they end
in ``ppermute`` steps. The steps are unrolled: there are only about log2(n) of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._core.axis import Axis, is_rank, permute
from .._core.lowering import tree_broadcast
from .._core.ops import ReduceOp, combine_fn, finish_avg
from .._core.vma import ensure_varying, replicated
from ._shapes import leaf_ops

PACKS = True  # leaves of one dtype travel as one buffer


def _pow2_below(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def all_reduce(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """Recursive-doubling all-reduce (see the module docstring), any n."""
    n = ax.size
    if n == 1:
        return x
    fn = combine_fn(op, kind)
    x = ensure_varying(x, ax)
    r = ax.rank()
    p = _pow2_below(n)
    e = n - p
    acc = x
    if e:  # ranks p..n-1 fold into ranks 0..e-1
        recv = permute(acc, ax, [(p + i, i) for i in range(e)])
        acc = jnp.where(r < e, fn(acc, recv), acc)
    d = 1
    while d < p:
        recv = permute(acc, ax, [(i, i ^ d) for i in range(p)])
        upper = (r & d) != 0  # this rank is the higher of the pair: fold recv op acc
        acc = jnp.where(upper, fn(recv, acc), fn(acc, recv))
        d *= 2
    if e:  # hand the result back to ranks p..n-1
        recv = permute(acc, ax, [(i, p + i) for i in range(e)])
        acc = jnp.where(r >= p, recv, acc)
    return replicated(finish_avg(acc, op, n), ax)


def reduce(x: jax.Array, ax: Axis, dst: int, op: ReduceOp, kind: str) -> jax.Array:
    """Binomial-tree reduce to ``dst``: relative rank v sends to v - 2**k when v % 2**(k+1)
    is 2**k. ``dst`` gets the fold; every other rank keeps its own ``x``."""
    n = ax.size
    if n == 1:
        return x
    fn = combine_fn(op, kind)
    x = ensure_varying(x, ax)
    acc = x
    d = 1
    while d < n:
        senders = [v for v in range(n) if v % (2 * d) == d]
        pairs = [((dst + v) % n, (dst + v - d) % n) for v in senders]
        recv = permute(acc, ax, pairs)
        acc = jnp.where(is_rank(ax, [b for _, b in pairs]), fn(acc, recv), acc)
        d *= 2
    return jnp.where(is_rank(ax, dst), finish_avg(acc, op, n), x)


def broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    """Binomial-tree broadcast from ``src``, ceil(log2 n) steps, bit-exact."""
    if ax.size == 1:
        return x
    return replicated(tree_broadcast(x, ax, src), ax)


def _stacked(x: jax.Array, ax: Axis) -> jax.Array:
    """Bruck all-gather: ``(n, *x.shape)`` in rank order after ceil(log2 n) steps."""
    n = ax.size
    x = ensure_varying(x, ax)
    if n == 1:
        return x[None]
    buf = x[None]  # buf[j] holds the part of rank r + j
    d = 1
    while d < n:
        k = min(d, n - d)
        recv = lax.ppermute(buf[:k], ax.name, [(i, (i - d) % n) for i in range(n)])
        buf = jnp.concatenate([buf, recv])
        d *= 2
    return replicated(jnp.roll(buf, ax.rank(), axis=0), ax)  # out[j] = buf[j - r]


def reduce_scatter_rows(rows: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """``rows`` is ``(n, m)``; rank r gets row r of the recursive-doubling all-reduce."""
    full = all_reduce(rows, ax, op, kind)
    if ax.size == 1:
        return finish_avg(full[0], op, 1)
    return lax.dynamic_index_in_dim(full, ax.rank(), keepdims=False)


# Bruck all-gather and recursive-doubling reduce-scatter of a whole leaf, placed like
# lax.all_gather and lax.psum_scatter.
all_gather, reduce_scatter = leaf_ops(_stacked, reduce_scatter_rows)
