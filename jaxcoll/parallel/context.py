"""Context parallelism: attention over a sequence split across a mesh axis.

The sequence is split over the context axis in the *load-balanced* order torchtitan and
Megatron use: cut into ``2n`` equal chunks, rank ``r`` holds chunks ``r`` and ``2n-1-r`` (in
that order), so under a causal mask every rank has as much to compute.
:func:`context_order` is that order (a permutation of the positions),
:func:`to_context_order` / :func:`from_context_order` put a global array into it and back,
and :func:`context_positions` gives a rank the global positions of its tokens (for position
embeddings). Everything but attention is per token and needs nothing more.

:func:`context_attention` computes attention over the whole sequence from each rank's part
of it, by one of two methods, picked by a value; the keys and values may have fewer heads
than the queries (grouped-query attention, each group of consecutive query heads sharing one
key/value head):

* :class:`Ring` (ring attention): the K/V blocks travel round the ring (``n - 1`` shifts by
  :func:`~jaxcoll.primitives.shift`), each rank folding every block into an online softmax;
  under the causal mask the blocks a rank would mask whole are skipped (every rank computes
  ``2n + 2`` blocks of ``(S/2n)^2``, the load balanced exactly); the backward is a ring of
  its own (K, V and their gradients travel together: ``n`` shifts), not autodiff through a
  stack of every K/V. Only the key/value heads travel: grouped-query attention sends
  ``Hkv / H`` of the bytes multi-head attention sends;
* :class:`Ulysses` (DeepSpeed-Ulysses): one all-to-all turns the sequence split into a head
  split, each rank attends over the whole sequence for ``H/n`` heads, one all-to-all turns it
  back (twice more in the backward); the query heads must divide by ``n``. The key/value
  heads are split over the ranks as they are; where ``Hkv`` does not divide by ``n``, each is
  first repeated to ``lcm(Hkv, n)`` heads (so that every rank gets the ones its query heads
  use: ``lcm(Hkv, n) / n`` of them, never more than ``Hkv``).

Where the context axis is not bound, :func:`context_attention` is plain attention over the
sequence it is given; inside a ``jax.shard_map`` an axis its mesh lacks is refused.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import primitives
from .._core import roles
from .._core.checks import check_instance
from .._core.context import context_order as context_order
from .._core.context import local_part
from .._core.context import positions as _positions
from .._core.roles import Role
from .._core.typing import AxisName
from .._core.vma import axis_names, to_varying, types_tracked, varying_axes
from .axes import bound_axis


@dataclass(frozen=True)
class Ring:
    """Ring attention (Liu et al.; torchtitan's and Megatron's context parallel): K/V blocks
    passed round the ring, an online softmax, the causal mask load-balanced."""


@dataclass(frozen=True)
class Ulysses:
    """DeepSpeed-Ulysses: all-to-all from the sequence split to a head split and back; the
    number of query heads must divide by the axis size."""


# A layout's ``attention`` is checked against these (jaxcoll.dp may not import parallel).
roles.CONTEXT_METHODS.update(ring=Ring, ulysses=Ulysses)


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
    split over ``axis_name`` (``arange(local_length)`` where the axis is not bound; inside a
    ``jax.shard_map`` whose mesh has no such axis, ValueError)."""
    axis = _bound_axis(axis_name, "parallel.context_positions")
    if axis is None:
        return jnp.arange(local_length)
    n = primitives.world_size(axis)
    return _positions(lax.axis_index(axis), n, local_length // 2)


def context_part(x: jax.Array, axis_name: AxisName = Role.CONTEXT, dim: int = 1) -> jax.Array:
    """This rank's part of ``x`` in the load-balanced order, from ``x`` whole along dim
    ``dim`` on every rank (a batch of token ids, say); ``x`` itself where the axis is not
    bound (inside a ``jax.shard_map`` whose mesh has no such axis, ValueError)."""
    axis = _bound_axis(axis_name, "parallel.context_part")
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

        def attention(q, k, v):   # q (..., S, H, D), k and v (..., S, Hkv, D), S the whole
            g = H // Hkv          # sequence; query head h uses key/value head h // g
            k, v = jnp.repeat(k, g, axis=-2), jnp.repeat(v, g, axis=-2)
            w = softmax(einsum("...qhd,...khd->...hqk", q, k) * scale,
                        masked to k <= q if causal)
            return einsum("...hqk,...khd->...qhd", w, v)

    with ``q, k, v`` this rank's ``S / n`` tokens in the load-balanced order
    (:func:`to_context_order`); ``Hkv < H`` is grouped-query attention (``Hkv = 1``:
    multi-query), grouped as ``jax.nn.dot_product_attention`` groups them. ``scale`` defaults
    to ``1 / sqrt(D)``. Where ``axis_name`` is not bound it is that dense attention over the
    sequence given (in its own order).

    Lowering: :class:`Ring`, ``n - 1`` collective-permutes of K and V (``Hkv`` heads, never
    repeated: each block groups the query heads), ``n`` shifts of K, V and their gradients in
    the backward; :class:`Ulysses`, all-to-alls of q, of K and V (``lcm(Hkv, n)`` heads: each
    repeated ``lcm(Hkv, n) / Hkv`` times first) and of the output.

    Args:
        q: the queries, ``(..., S_local, H, D)``: any leading (batch) dims, this rank's
            tokens, the heads and the head width.
        k: the keys, ``(..., S_local, Hkv, D)``, ``H`` a multiple of ``Hkv``.
        v: the values, shaped as ``k``.
        axis_name: the context axis (a role: a ``dp.Trainer``'s layout gives it): the axis
            the sequence is split over.
        method: :class:`Ring` or :class:`Ulysses` (query heads divisible by the axis size).
        causal: each position attends to itself and the positions before it.
        scale: the scores' scale.

    Returns:
        ``(..., S_local, H, D)``: this rank's rows of the output.

    Raises:
        ValueError: the shapes disagree; inside a ``jax.shard_map``, ``axis_name`` is not an
            axis of its mesh (a misspelling would attend within each device's part), or q, k
            or v is the same on every rank of it, or a layout splits the batch's examples
            over it (the sequence is split over another axis); an odd local length;
            Ulysses with query heads that do not divide by the axis size.
    """
    api = "parallel.context_attention"
    _check_shapes(api, q, k, v)
    check_instance(api, "method", method, (Ring, Ulysses), "parallel.Ring() or parallel.Ulysses()")
    scale = float(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    axis = _bound_axis(axis_name, api)
    if axis is None:
        pos = jnp.arange(q.shape[-3])
        return _dense(q, k, v, pos, pos, causal, scale)
    _check_split(api, axis_name, axis, {"q": q, "k": k, "v": v})
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
    axis = _bound_axis(axis_name, "parallel.ring_blocks")
    return _ring_fwd_pass(z, z, z, axis, primitives.world_size(axis), causal, 1.0)[2]


# ------------------------------------------------------------------------------- checks
def _check_shapes(api: str, q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    same = k.shape == v.shape and q.shape[:-2] + q.shape[-1:] == k.shape[:-2] + k.shape[-1:]
    if q.ndim < 3 or not same or not k.shape[-2] or q.shape[-2] % k.shape[-2]:
        raise ValueError(
            f"{api}: q must be (..., S_local, H, D) and k and v one shape (..., S_local, Hkv, "
            f"D), with H a multiple of Hkv (grouped-query attention; Hkv = H: multi-head), got "
            f"q {q.shape}, k {k.shape} and v {v.shape}."
        )


def _shown(axis_name: AxisName, axis: Any) -> str:
    """`` (the mesh axis 'x')`` where a role stands for another name, else nothing."""
    return "" if axis == axis_name else f" (the mesh axis {axis!r})"


def _bound_axis(axis_name: AxisName, api: str) -> Any:
    """The mesh axis of ``axis_name`` where bound, else None (dense); inside a shard_map
    whose mesh has no such axis, ValueError (a misspelling must not run dense)."""
    axis = bound_axis(axis_name, api)
    if axis is None:
        _refuse_absent(api, axis_name)
    return axis


def _refuse_absent(api: str, axis_name: AxisName) -> None:
    # Unbound is dense: right outside any shard_map, and inside one where the mesh's axis is
    # not manual (GSPMD's); where the mesh has no such axis it is a misspelling.
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(sorted(getattr(mesh, "manual_axes", ()) or (), key=str))
    axis = roles.axis(axis_name)
    if not manual or axis is None:
        return
    names = tuple(mesh.axis_names)
    absent = [a for a in axis_names(axis) if a not in names]
    if absent:
        raise ValueError(
            f"{api}: axis_name={axis_name!r}{_shown(axis_name, axis)} is not an axis of the "
            f"mesh of the jax.shard_map it is called in (its axes: {names!r}), so nothing "
            f"splits the sequence over it and each device would attend within its own part. "
            f"Pass the axis the sequence is split over (one of {manual!r}); the dense "
            f"attention is what it runs outside any jax.shard_map, or under a dp.Layout "
            f"without a context role."
        )


def _check_split(api: str, axis_name: AxisName, axis: Any, arrays: dict) -> None:
    """Refuse a bound axis the sequence is not split over, where that shows: a layout splits
    the batch's examples over it, or (under check_vma) an input is the same on all its ranks."""
    names = axis_names(axis)
    binding = roles.active()
    tokens = () if binding is None else axis_names(binding.axes.get("batch") or ())
    context = None if binding is None else binding.axes.get(Role.CONTEXT.value)
    data = [a for a in names if a in tokens and a not in axis_names(context or ())]
    if data:
        raise ValueError(
            f"{api}: axis_name={axis_name!r}{_shown(axis_name, axis)} is an axis the layout "
            f"splits the batch's examples over ({data!r}), not their sequence. Pass the "
            f"layout's context axis, {context!r} (the default axis_name: the context role)."
        )
    if not types_tracked(names):
        return
    for arg, x in arrays.items():
        vma = varying_axes(x)
        same = [a for a in names if vma is not None and a not in vma]
        if same:
            raise ValueError(
                f"{api}: axis_name={axis_name!r}{_shown(axis_name, axis)} is not the axis the "
                f"sequence is split over: {arg} is the same on every rank of {same!r} (it "
                f"varies over {tuple(sorted(vma or (), key=str))!r} only), so a ring or an "
                f"all-to-all over it would mix copies of one part. Pass the axis whose "
                f"in_specs entry splits the sequence dim of q, k and v."
            )


# ---------------------------------------------------------------------------- internals
def _grouped(x, hkv):
    """``(..., S, H, D)`` as ``(..., S, Hkv, H/Hkv, D)``: query head ``h`` is group
    ``h // (H/Hkv)``, member ``h % (H/Hkv)`` (jax.nn.dot_product_attention's grouping)."""
    return x.reshape(*x.shape[:-2], hkv, x.shape[-2] // hkv, x.shape[-1])


def _by_group(s, hkv):
    """``(..., H, Sq, Sk)`` scores as ``(..., Hkv, H/Hkv, Sq, Sk)``."""
    return s.reshape(*s.shape[:-3], hkv, s.shape[-3] // hkv, *s.shape[-2:])


def _scores(q, k, scale):
    """``(..., H, Sq, Sk)``: q ``(..., Sq, H, D)`` against k ``(..., Sk, Hkv, D)``."""
    qg = _grouped(q, k.shape[-2])
    s = jnp.einsum("...qhgd,...khd->...hgqk", qg, k, preferred_element_type=jnp.float32)
    return s.reshape(*s.shape[:-4], -1, *s.shape[-2:]) * scale


def _weigh(p, v):
    """``(..., Sq, H, D)``: the weights ``p`` ``(..., H, Sq, Sk)`` times v ``(..., Sk, Hkv,
    D)``, each query head's group's values."""
    o = jnp.einsum("...hgqk,...khd->...qhgd", _by_group(p, v.shape[-2]), v)
    return o.reshape(*o.shape[:-3], -1, o.shape[-1])


def _dense(q, k, v, qpos, kpos, causal, scale):
    s = _scores(q, k, scale)
    if causal:
        s = jnp.where(kpos[None, :] <= qpos[:, None], s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    return _weigh(w.astype(v.dtype), v)


def _ulysses(q, k, v, axis, n, causal, scale):
    # Sequence split -> head split: each rank all the tokens (rank j's in rank order) of
    # H/n query heads and of the key/value heads they use; back after the attention. Where
    # n does not divide the Hkv key/value heads, each is repeated to lcm(Hkv, n) heads
    # first: rank j then gets heads j*m/n .. (j+1)*m/n - 1 of them (m = lcm), exactly the
    # ones its query heads j*H/n .. use (query head h: repeated head h // (H/m)).
    hkv = k.shape[-2]
    m = math.lcm(hkv, n)
    if m != hkv:
        k, v = (jnp.repeat(x, m // hkv, axis=-2) for x in (k, v))
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
    pv = _weigh(p, v.astype(jnp.float32))
    o_new = o * jnp.swapaxes(corr, -1, -2)[..., None] + pv
    return o_new, m_new, den_new


def _grads(q, k, v, do, lse, delta, mask, scale):
    """The block's contributions to ``(dq, dk, dv)`` (flash attention's backward; the
    key/value gradients summed over each group's query heads)."""
    hkv = k.shape[-2]
    s = _scores(q, k, scale)
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dof = _grouped(do.astype(jnp.float32), hkv)
    dv = jnp.einsum("...hgqk,...qhgd->...khd", _by_group(p, hkv), dof)
    dp = jnp.einsum("...qhgd,...khd->...hgqk", dof, v.astype(jnp.float32))
    ds = p * (dp.reshape(p.shape) - delta[..., None]) * scale
    dq = _weigh(ds, k.astype(jnp.float32))
    qf = _grouped(q.astype(jnp.float32), hkv)
    dk = jnp.einsum("...hgqk,...qhgd->...khd", _by_group(ds, hkv), qf)
    return dq, dk, dv


def _rows(x, part, c, dim=-3):
    """``x``'s rows (dim -3 of ``(..., S, H, D)``, -1 of ``(..., H, S)``) of ``part``:
    "all", "first" or "second" chunk."""
    start = 0 if part == "first" else c
    return x if part == "all" else lax.slice_in_dim(x, start, start + c, axis=dim)


def _put_rows(x, new, part, c, dim=-3):
    """``x`` with its rows of ``part`` (:func:`_rows`) replaced by ``new``."""
    if part == "all":
        return new
    pair = (
        (new, _rows(x, "second", c, dim)) if part == "first" else (_rows(x, "first", c, dim), new)
    )
    return jnp.concatenate(pair, dim)


def _add_rows(x, value, part, c):
    return _put_rows(x, _rows(x, part, c) + value, part, c)


def _step(t, r, n, c, causal):
    """The blocks of step ``t`` for rank ``r`` (traced) as a branch index: 0 the diagonal
    step (every block, masked by position), 1 both query chunks against the first K/V chunk,
    2 the second query chunk against both K/V chunks, 3 every block unmasked; a Python int
    where every rank takes one (no branch in the program), else 1 or 2 traced."""
    if not causal:
        return 3
    if t == 0:
        return 0
    s = (r - t) % n
    return jnp.where(s < r, 1, 2)


def _switch(branch, fns, *args):
    """``fns[branch](*args)``; a traced ``branch`` (1 or 2) by a ``lax.cond`` of those two."""
    if isinstance(branch, int):
        return fns[branch](*args)
    return lax.cond(branch == 1, fns[1], fns[2], *args)


# The (query rows, K/V rows) each branch of _step computes; the diagonal step's mask comes
# from the positions.
_BRANCHES = (("all", "all"), ("all", "first"), ("second", "all"), ("all", "all"))
_UNITS = (4, 2, 2, 4)  # its (S/2n)^2 blocks
_ACC_DIMS = (-3, -1, -1)  # the rows' dim of the accumulators (o, m, den)


def _ring_fwd_pass(q, k, v, axis, n, causal, scale):
    r = lax.axis_index(axis)
    c = q.shape[-3] // 2
    f32, rows = jnp.float32, (*q.shape[:-3], q.shape[-2], q.shape[-3])  # (..., H, S_local)
    acc = (jnp.zeros(q.shape, f32), jnp.full(rows, -jnp.inf, f32), jnp.zeros(rows, f32))
    acc = to_varying(acc, _types(axis_names(axis), q, k, v))
    units = jnp.zeros((), jnp.int32)
    pos = _positions(r, n, c)
    kv = (k, v)  # Hkv heads: the query heads are grouped in each block, never repeated
    for t in range(n):
        branch = _step(t, r, n, c, causal)

        def run(i, acc=acc, kv=kv, t=t):
            qrows, kvrows = _BRANCHES[i]
            mask = (pos[None, :] <= pos[:, None]) if (i == 0 and causal) else None
            sub = tuple(_rows(a, qrows, c, d) for a, d in zip(acc, _ACC_DIMS, strict=True))
            kk, vv = (_rows(x, kvrows, c) for x in kv)
            new = _fold(sub, _rows(q, qrows, c), kk, vv, mask, scale)
            return tuple(
                _put_rows(a, b, qrows, c, d) for a, b, d in zip(acc, new, _ACC_DIMS, strict=True)
            )

        acc = _switch(branch, [lambda a, i=i: run(i, a) for i in range(4)], acc)
        units = units + jnp.asarray(_UNITS)[branch]
        if t < n - 1:
            # K and V cross devices here: one step round the ring.
            kv = primitives.shift(kv, axis, 1)
    o, m, den = acc
    lse = m + jnp.log(den)
    out = (o / jnp.swapaxes(den, -1, -2)[..., None]).astype(q.dtype)
    return out, lse, units


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
    delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1), -1, -2)
    pos = _positions(r, n, c)
    types = _types(axis_names(axis), q, k, v)
    dq = to_varying(jnp.zeros(q.shape, jnp.float32), types)
    zeros = to_varying(jnp.zeros(k.shape, jnp.float32), types)  # Hkv heads, as K and V
    kv = (k, v, zeros, zeros)
    for t in range(n):
        branch = _step(t, r, n, c, causal)

        def run(i, dq, kv):
            qrows, kvrows = _BRANCHES[i]
            mask = (pos[None, :] <= pos[:, None]) if (i == 0 and causal) else None
            kk, vv, dk, dv = kv
            gq, gk, gv = _grads(
                _rows(q, qrows, c),
                _rows(kk, kvrows, c),
                _rows(vv, kvrows, c),
                _rows(do, qrows, c),
                _rows(lse, qrows, c, -1),
                _rows(delta, qrows, c, -1),
                mask,
                scale,
            )
            dk, dv = _add_rows(dk, gk, kvrows, c), _add_rows(dv, gv, kvrows, c)
            return _add_rows(dq, gq, qrows, c), (kk, vv, dk, dv)

        dq, kv = _switch(branch, [lambda a, b, i=i: run(i, a, b) for i in range(4)], dq, kv)
        # K, V and their gradients so far cross devices here: one step round the ring (the
        # last step sends the gradients alone, home to the rank that owns the block).
        kv = (
            primitives.shift(kv, axis, 1)
            if t < n - 1
            else (kv[0], kv[1], *primitives.shift(kv[2:], axis, 1))
        )
    _, _, dk, dv = kv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring_core.defvjp(_ring_core_fwd, _ring_core_bwd)


def _types(names, *xs):
    """The axes the ring's accumulators vary over: ``names`` and every input's."""
    vma = set().union(*(varying_axes(x) or () for x in xs))
    return names + tuple(sorted(vma - set(names), key=str))
