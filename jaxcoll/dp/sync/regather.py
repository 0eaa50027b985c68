"""FSDP's backward re-gather of a segment's params, tied to the segment's cotangent.

``jax.checkpoint`` makes a segment's backward gather its params again instead of keeping the
forward's gathered copies alive, and marks the re-gathers with optimization barriers; XLA:CPU
drops those barriers before it eliminates duplicate work, so it merges each re-gather with
the forward's gather and every gathered block stays alive into the backward. Here the
backward's slices are computed from the cotangent that reaches the segment
(``x * (1 + 0 * sum(ct))``, equal to ``x`` bit for bit), so the re-gather can neither be
merged with the forward's nor be moved before the cotangent exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..._core.vma import as_invariant, varying_axes


def regathered(
    fn: Callable[..., Any], policy: Callable[..., bool], args: Sequence[Any], lazy: Sequence[int]
) -> Any:
    """``jax.checkpoint(fn, policy=policy)(*args)`` whose backward gathers the lazy params
    (``args[i]`` for ``i`` in ``lazy``, slices) again from slices tied to the cotangent."""
    ckpt = jax.checkpoint(fn, policy=policy)
    if not lazy:
        return ckpt(*args)
    at: list[int] = []  # where the lazy slices sit among the residuals' leaves

    @jax.custom_vjp
    def segment(*xs):
        return ckpt(*xs)

    def fwd(*xs):
        out, pullback = jax.vjp(ckpt, *xs)
        leaves = jax.tree_util.tree_leaves(pullback)
        at[:] = [j for j, r in enumerate(leaves) if any(r is xs[i] for i in lazy)]
        return out, pullback

    def bwd(pullback, ct):
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        token = _token(ct)
        if token is not None:
            for j in at:
                leaves[j] = _tie(leaves[j], token)
        return jax.tree_util.tree_unflatten(treedef, leaves)(ct)

    segment.defvjp(fwd, bwd)
    return segment(*args)


def _token(ct: Any) -> jax.Array | None:
    """A scalar computed from every element of every float cotangent in ``ct`` (their sum,
    0 where not finite): a gather tied to it waits for the whole cotangent (from one element
    XLA would compute that element alone, early, through sliced ops); None: no float
    cotangent."""
    sums = [
        jnp.sum(x) for x in jax.tree_util.tree_leaves(ct) if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not sums:
        return None
    c = sum(sums[1:], sums[0])
    return jnp.where(jnp.isfinite(c), c, jnp.zeros_like(c))


def _tie(x: jax.Array, token: jax.Array) -> jax.Array:
    """``x``, bit for bit, computed from ``token`` too: ``x * (1 + 0 * token)``."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    one = (1 + 0 * token).astype(x.dtype)
    tied = x * one
    extra = (varying_axes(tied) or frozenset()) - (varying_axes(x) or frozenset())
    return as_invariant(tied, tuple(extra)) if extra else tied
