"""FSDP's backward re-gather of a segment's params, tied to the segment's cotangent.

``jax.checkpoint`` makes a segment's backward gather its params again instead of keeping the
forward's gathered copies alive, and marks the re-gathers with optimization barriers; XLA:CPU
drops those barriers before it eliminates duplicate work, so it merges each re-gather with
the forward's gather and every gathered block stays alive into the backward. Here the
backward's slices are computed from the cotangent that reaches the segment
(``x * (1 + 0 * sum(ct))``, equal to ``x`` bit for bit), so the re-gather can neither be
merged with the forward's nor be moved before the cotangent exists.

Backward prefetch (torch FSDP's ``BACKWARD_PRE``): a segment's re-gather is tied to the
cotangent that reaches the *next* segment, not its own, so it may start while the next
segment's backward computes, one segment ahead (two segments' params gathered at a time, as
FSDP's prefetch holds). The cotangent travels by a *link*: a scalar each segment returns
(zero, unused by the forward) and the next takes; in the backward, the next segment returns
as the link's cotangent a token of the cotangent that reached it. The last two segments tie
to their own (the caller says which are ``last``): the very last one's cotangent is the
loss's seed, a constant XLA folds, which would make the re-gather tied to it the forward's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..._core.vma import as_invariant, varying_axes


def regathered(
    fn: Callable[..., Any],
    policy: Callable[..., bool],
    args: Sequence[Any],
    lazy: Sequence[int],
    link: jax.Array | None = None,
    *,
    last: bool = True,
) -> tuple[Any, jax.Array | None]:
    """``(jax.checkpoint(fn, policy=policy)(*args), link)``: the backward gathers the lazy
    params (``args[i]`` for ``i`` in ``lazy``, slices) again from slices tied to the
    cotangent of the next segment (``last``: of this one), which arrives by the link this
    returns (None when ``last``); ``link``: the previous segment's (None for the first)."""
    ckpt = jax.checkpoint(fn, policy=policy)
    if not lazy and link is None and last:
        return ckpt(*args), None
    at: list[int] = []  # where the lazy slices sit among the residuals' leaves

    @jax.custom_vjp
    def segment(xs, link_in):
        return ckpt(*xs), (None if last else jnp.zeros((), jnp.float32))

    def fwd(xs, link_in):
        out, pullback = jax.vjp(ckpt, *xs)
        leaves = jax.tree_util.tree_leaves(pullback)
        at[:] = [j for j, r in enumerate(leaves) if any(r is xs[i] for i in lazy)]
        return (out, None if last else jnp.zeros((), jnp.float32)), pullback

    def bwd(pullback, cts):
        ct, ct_link = cts
        own = _token(ct)
        token = own if last else ct_link
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        if token is not None:
            for j in at:
                leaves[j] = tie(leaves[j], token)
        grads = list(jax.tree_util.tree_unflatten(treedef, leaves)(ct))
        if link is None:
            return grads, None
        # The previous segment's re-gather waits for this: the cotangent reaching this one.
        back = jnp.zeros((), jnp.float32) if own is None else own.astype(jnp.float32)
        return grads, as_invariant(back, tuple(sorted(varying_axes(back) or (), key=str)))

    segment.defvjp(fwd, bwd)
    return segment(list(args), link)


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


def tie(x: jax.Array, token: jax.Array) -> jax.Array:
    """``x``, bit for bit, computed from ``token`` too: ``x * (1 + 0 * token)``."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    one = (1 + 0 * token).astype(x.dtype)
    tied = x * one
    extra = (varying_axes(tied) or frozenset()) - (varying_axes(x) or frozenset())
    return as_invariant(tied, tuple(extra)) if extra else tied


def forward_token(values: Sequence[Any]) -> jax.Array | None:
    """A scalar that exists once every float array of ``values`` does (:func:`_token`),
    without a gradient: what a forward gather tied to it (:func:`tie`) waits for."""
    token = _token(list(values))
    return None if token is None else jax.lax.stop_gradient(token)
