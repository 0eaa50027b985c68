"""Context parallelism: attention over a sequence split across a mesh axis.

The sequence is split over the context axis in the *load-balanced* order torchtitan and
Megatron use: cut into ``2n`` equal chunks, rank ``r`` holds chunks ``r`` and ``2n-1-r`` (in
that order), so under a causal mask every rank has as much to compute.
:func:`context_order` is that order (a permutation of the positions),
:func:`to_context_order` / :func:`from_context_order` put a global array into it and back,
and :func:`context_positions` gives a rank the global positions of its tokens (for position
embeddings). Everything but attention is per token and needs nothing more.

:func:`context_attention` computes attention over the whole sequence from each rank's part
of it, by one of two methods, picked by a value:

* :class:`Ring` (ring attention): the K/V blocks travel round the ring (``n - 1`` shifts by
  :func:`~jaxcoll.primitives.shift`), each rank folding every block into an online softmax;
  under the causal mask the blocks a rank would mask whole are skipped (every rank computes
  ``2n + 2`` blocks of ``(S/2n)^2``, the load balanced exactly); the backward is a ring of
  its own (K, V and their gradients travel together: ``n`` shifts), not autodiff through a
  stack of every K/V;
* :class:`Ulysses` (DeepSpeed-Ulysses): one all-to-all turns the sequence split into a head
  split, each rank attends over the whole sequence for ``H/n`` heads, one all-to-all turns it
  back (twice more in the backward); the heads must divide by ``n``.

Where the context axis is not bound, :func:`context_attention` is plain attention over the
sequence it is given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import primitives
from .._core.checks import check_instance
from .._core.context import context_order as context_order
from .._core.context import local_part
from .._core.context import positions as _positions
from .._core.roles import Role
from .._core.typing import AxisName
from .._core.vma import to_varying, varying_axes
from .axes import bound_axis


@dataclass(frozen=True)
class Ring:
    """Ring attention (Liu et al.; torchtitan's and Megatron's context parallel): K/V blocks
    passed round the ring, an online softmax, the causal mask load-balanced."""


@dataclass(frozen=True)
class Ulysses:
    """DeepSpeed-Ulysses: all-to-all from the sequence split to a head split and back; the
    number of heads must divide by the axis size."""


def to_context_order(x: jax.Array, n: int, dim: int = 1) -> jax.Array:
    """``x`` (a global array, its sequence along dim ``dim``) put in the load-balanced order
    (:func:`context_order`), so that a contiguous split over ``n`` ranks gives each rank its
    part."""
    return jnp.take(x, context_order(x.shape[dim], n), axis=dim)


def from_context_order(x: jax.Array, n: int, dim: int = 1) -> jax.Array:
    """Inverse of :func:`to_context_order`: ``x``'s sequence along dim ``dim`` back in its
    own order."""
    return jnp.take(x, np.argsort(context_order(x.shape[dim], n)), axis=dim)


def context_positions(local_length: int, axis_name: AxisName = Role.CONTEXT) -> jax.Array:
    """The global positions of this rank's ``local_length`` tokens under the load-balanced
    split over ``axis_name`` (``arange(local_length)`` where the axis is not bound)."""
    axis = _bound_axis(axis_name)
    if axis is None:
        return jnp.arange(local_length)
    n = primitives.world_size(axis)
    return _positions(lax.axis_index(axis), n, local_length // 2)


def context_part(x: jax.Array, axis_name: AxisName = Role.CONTEXT, dim: int = 1) -> jax.Array:
    """This rank's part of ``x`` in the load-balanced order, from ``x`` whole along dim
    ``dim`` on every rank (a batch of token ids, say); ``x`` itself where the axis is not
    bound."""
    axis = _bound_axis(axis_name)
    if axis is None:
        return x
    return local_part(x, axis, primitives.world_size(axis), dim)


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    axis_name: AxisName = Role.CONTEXT,
    *,
    method: Ring | Ulysses = Ring(),  # noqa: B008 - a frozen value
    causal: bool = True,
    scale: float | None = None,
) -> jax.Array:
    """Attention of this rank's queries over the whole sequence (every rank's keys and values).

    Equivalent to the dense attention over the whole sequence, each rank's rows of it::

        def attention(q, k, v):            # (..., S, H, D) each, S the whole sequence
            w = softmax(einsum("...qhd,...khd->...hqk", q, k) * scale,
                        masked to k <= q if causal)
            return einsum("...hqk,...khd->...qhd", w, v)

    with ``q, k, v`` this rank's ``S / n`` tokens in the load-balanced order
    (:func:`to_context_order`). ``scale`` defaults to ``1 / sqrt(D)``. Where ``axis_name`` is
    not bound it is that dense attention over the sequence given (in its own order).

    Args:
        q: the queries, ``(..., S_local, H, D)``: any leading (batch) dims, this rank's
            tokens, the heads and the head width.
        k: the keys, shaped as ``q``.
        v: the values, shaped as ``q``.
        axis_name: the context axis (a role: a ``dp.Trainer``'s layout gives it).
        method: :class:`Ring` or :class:`Ulysses` (heads divisible by the axis size).
        causal: each position attends to itself and the positions before it.
        scale: the scores' scale.

    Returns:
        ``(..., S_local, H, D)``: this rank's rows of the output.
    """
    api = "parallel.context_attention"
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"{api}: q, k and v must have one shape (..., S_local, H, D), got {q.shape}, "
            f"{k.shape} and {v.shape}."
        )
    check_instance(api, "method", method, (Ring, Ulysses), "parallel.Ring() or parallel.Ulysses()")
    scale = float(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    axis = _bound_axis(axis_name)
    if axis is None:
        pos = jnp.arange(q.shape[-3])
        return _dense(q, k, v, pos, pos, causal, scale)
    n = primitives.world_size(axis)
    if q.shape[-3] % 2:
        raise ValueError(
            f"{api}: each rank holds two chunks of the sequence, so its tokens ({q.shape[-3]}) "
            f"must be even; pick a sequence divisible by {2 * n}."
        )
    if isinstance(method, Ulysses):
        if q.shape[-2] % n:
            raise ValueError(
                f"{api}: Ulysses splits the {q.shape[-2]} heads over the {n} ranks of "
                f"{axis!r}; use a head count divisible by {n}, or method=parallel.Ring()."
            )
        return _ulysses(q, k, v, axis, n, causal, scale)
    return _ring_core(q, k, v, (axis, n, causal, scale))


def ring_blocks(q_shape: tuple, axis_name: AxisName, causal: bool) -> jax.Array:
    """The number of ``(S/2n)^2`` score blocks this rank's ring attention computes (a
    measure of its load), counted by the same program that computes them."""
    z = jnp.zeros(q_shape, jnp.float32)
    axis = _bound_axis(axis_name)
    return _ring_fwd_pass(z, z, z, axis, primitives.world_size(axis), causal, 1.0)[2]


# ---------------------------------------------------------------------------- internals
def _bound_axis(axis_name: AxisName) -> Any:
    return bound_axis(axis_name, "parallel.context_attention")


def _scores(q, k, scale):
    return jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32) * scale


def _dense(q, k, v, qpos, kpos, causal, scale):
    s = _scores(q, k, scale)
    if causal:
        s = jnp.where(kpos[None, :] <= qpos[:, None], s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", w.astype(v.dtype), v)


def _ulysses(q, k, v, axis, n, causal, scale):
    # Sequence split -> head split: each rank all the tokens (rank j's in rank order) of
    # H/n heads; back after the attention.
    h, s = q.ndim - 2, q.ndim - 3
    qg, kg, vg = (primitives.all_to_all(x, axis, h, s, tiled=True) for x in (q, k, v))
    c = q.shape[-3] // 2
    pos = jnp.concatenate([_positions(j, n, c) for j in range(n)])
    o = _dense(qg, kg, vg, pos, pos, causal, scale)
    return primitives.all_to_all(o, axis, s, h, tiled=True)


def _fold(acc, q, k, v, mask, scale):
    """The online softmax's accumulators ``(o, m, den)`` for the rows of ``q`` with the block
    ``k, v`` folded in (``mask``: which scores count; None: all)."""
    o, m, den = acc
    s = _scores(q, k, scale)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - safe[..., None])
    corr = jnp.exp(m - safe)
    den_new = den * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("...hqk,...khd->...qhd", p, v.astype(jnp.float32))
    o_new = o * jnp.swapaxes(corr, -1, -2)[..., None] + pv
    return o_new, m_new, den_new


def _grads(g, q, k, v, do, lse, delta, mask, scale):
    """The block's contributions to ``(dq, dk, dv)`` (flash attention's backward)."""
    dq, dk, dv = g
    s = _scores(q, k, scale)
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dof = do.astype(jnp.float32)
    dv = dv + jnp.einsum("...hqk,...qhd->...khd", p, dof)
    dp = jnp.einsum("...qhd,...khd->...hqk", dof, v.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) * scale
    dq = dq + jnp.einsum("...hqk,...khd->...qhd", ds, k.astype(jnp.float32))
    dk = dk + jnp.einsum("...hqk,...qhd->...khd", ds, q.astype(jnp.float32))
    return dq, dk, dv


def _rows(x, part, c):
    """``x``'s rows (axis -3 of a ``(..., S, H, D)`` array; axis -1 of ``(..., H, S)``) of
    ``part``: "all", "first" or "second" chunk."""
    return x if part == "all" else (x[..., :c, :, :] if part == "first" else x[..., c:, :, :])


def _step(t, r, n, c, causal):
    """The blocks of step ``t`` for rank ``r`` (traced) as a branch index: 0 the diagonal
    step (every block, masked by position), 1 both query chunks against the first K/V chunk,
    2 the second query chunk against both K/V chunks, 3 every block unmasked."""
    if not causal:
        return jnp.asarray(3)
    if t == 0:
        return jnp.asarray(0)
    s = (r - t) % n
    return jnp.where(s < r, 1, 2)


# The (query rows, K/V rows) each branch of _step computes; the diagonal step's mask comes
# from the positions.
_BRANCHES = (("all", "all"), ("all", "first"), ("second", "all"), ("all", "all"))
_UNITS = (4, 2, 2, 4)  # its (S/2n)^2 blocks


def _ring_fwd_pass(q, k, v, axis, n, causal, scale):
    r = lax.axis_index(axis)
    c = q.shape[-3] // 2
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    lead = q.shape[:-3]
    h, sl = q.shape[-2], q.shape[-3]
    acc = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((*lead, h, sl), -jnp.inf, jnp.float32),
        jnp.zeros((*lead, h, sl), jnp.float32),
    )
    acc = to_varying(acc, names + tuple(sorted(varying_axes(q) or (), key=str)))
    units = jnp.zeros((), jnp.int32)
    pos = _positions(r, n, c)
    kv = (k, v)
    for t in range(n):
        branch = _step(t, r, n, c, causal)

        def run(i, acc=acc, kv=kv, t=t):
            qrows, kvrows = _BRANCHES[i]
            mask = (pos[None, :] <= pos[:, None]) if (i == 0 and causal) else None
            part = _fold(
                _sub_acc(acc, qrows, c),
                _rows(q, qrows, c),
                _rows(kv[0], kvrows, c),
                _rows(kv[1], kvrows, c),
                mask,
                scale,
            )
            return _put_acc(acc, part, qrows, c)

        acc = lax.switch(branch, [lambda a, i=i: run(i, a) for i in range(4)], acc)
        units = units + jnp.asarray(_UNITS)[branch]
        if t < n - 1:
            # K and V cross devices here: one step round the ring.
            kv = primitives.shift(kv, axis, 1)
    o, m, den = acc
    lse = m + jnp.log(den)
    out = (o / jnp.swapaxes(den, -1, -2)[..., None]).astype(q.dtype)
    return out, lse, units


def _sub_acc(acc, part, c):
    o, m, den = acc
    if part == "all":
        return acc
    sl = slice(None, c) if part == "first" else slice(c, None)
    return o[..., sl, :, :], m[..., sl], den[..., sl]


def _put_acc(acc, new, part, c):
    if part == "all":
        return new
    o, m, den = acc
    no, nm, nl = new
    if part == "first":
        return (
            jnp.concatenate([no, o[..., c:, :, :]], -3),
            jnp.concatenate([nm, m[..., c:]], -1),
            jnp.concatenate([nl, den[..., c:]], -1),
        )
    return (
        jnp.concatenate([o[..., :c, :, :], no], -3),
        jnp.concatenate([m[..., :c], nm], -1),
        jnp.concatenate([den[..., :c], nl], -1),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring_core(q, k, v, static):
    """Ring attention with its own ring backward (``static``: ``(axis, n, causal, scale)``)."""
    return _ring_fwd_pass(q, k, v, *static)[0]


def _ring_core_fwd(q, k, v, static):
    out, lse, _ = _ring_fwd_pass(q, k, v, *static)
    return out, (q, k, v, out, lse)


def _ring_core_bwd(static, res, do):
    axis, n, causal, scale = static
    q, k, v, out, lse = res
    r = lax.axis_index(axis)
    c = q.shape[-3] // 2
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1), -1, -2)
    pos = _positions(r, n, c)
    zeros = to_varying(
        jnp.zeros(q.shape, jnp.float32), names + tuple(sorted(varying_axes(q) or (), key=str))
    )
    dq = zeros
    kv = (k, v, zeros, zeros)
    for t in range(n):
        branch = _step(t, r, n, c, causal)

        def run(i, dq, kv):
            qrows, kvrows = _BRANCHES[i]
            mask = (pos[None, :] <= pos[:, None]) if (i == 0 and causal) else None
            kk, vv, dk, dv = kv
            gq, gk, gv = _grads(
                (jnp.zeros_like(_rows(dq, qrows, c)),)
                + (jnp.zeros_like(_rows(dk, kvrows, c)),) * 2,
                _rows(q, qrows, c),
                _rows(kk, kvrows, c),
                _rows(vv, kvrows, c),
                _rows(do, qrows, c),
                _rows_h(lse, qrows, c),
                _rows_h(delta, qrows, c),
                mask,
                scale,
            )
            return _add_rows(dq, gq, qrows, c), (
                kk,
                vv,
                _add_rows(dk, gk, kvrows, c),
                _add_rows(dv, gv, kvrows, c),
            )

        dq, kv = lax.switch(branch, [lambda a, b, i=i: run(i, a, b) for i in range(4)], dq, kv)
        # K, V and their gradients so far cross devices here: one step round the ring (the
        # last step sends the gradients alone, home to the rank that owns the block).
        kv = (
            primitives.shift(kv, axis, 1)
            if t < n - 1
            else (kv[0], kv[1], *primitives.shift(kv[2:], axis, 1))
        )
    _, _, dk, dv = kv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _rows_h(x, part, c):
    """:func:`_rows` for an ``(..., H, S)`` array."""
    return x if part == "all" else (x[..., :c] if part == "first" else x[..., c:])


def _add_rows(x, part_value, part, c):
    if part == "all":
        return x + part_value
    if part == "first":
        return jnp.concatenate([x[..., :c, :, :] + part_value, x[..., c:, :, :]], -3)
    return jnp.concatenate([x[..., :c, :, :], x[..., c:, :, :] + part_value], -3)


_ring_core.defvjp(_ring_core_fwd, _ring_core_bwd)
