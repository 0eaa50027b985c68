"""Lax patterns for the collectives that lax lacks (or lacks on some platforms).

Every helper here works on one array leaf and an already-validated :class:`Axis`. They are
built only from differentiable lax ops (``ppermute``, ``all_to_all``, ``all_gather``, selects),
so ``jax.grad`` of a pattern is the transpose of the pattern, with no custom rules to get wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._ops import ReduceOp, fold
from ._axis import Axis


def staged(*static_argnums: int):
    """Compile a per-leaf lowering as one unit, with its axis/op arguments static.

    Under ``jax.jit`` this changes nothing (the call is inlined). Under an eager ``shard_map``,
    which dispatches and compiles every op it meets, a collective then costs one compiled
    program instead of one per reshape, select and fold inside it.
    """
    return functools.partial(jax.jit, static_argnums=static_argnums)


def varying_axes(x: Any) -> frozenset | None:
    """The mesh axes ``x`` varies over (shard_map's check_vma type), or None if untyped."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # jax >= 0.11
    if vma is None:
        mat = getattr(aval, "mat", None)  # jax 0.10
        vma = getattr(mat, "varying", None)
    return vma


def ensure_varying(x: jax.Array, ax: Axis) -> jax.Array:
    """Mark ``x`` as varying over ``ax`` if shard_map types it as invariant there.

    Patterns whose branches must agree on type (``platform_dependent``), or that mix a value
    with a ppermute'd copy of it, need one consistent type to start from.
    """
    return cast_varying(x, ax.name if isinstance(ax.name, tuple) else (ax.name,))


def cast_varying(x: jax.Array, names: tuple) -> jax.Array:
    """Mark ``x`` varying over the mesh axes ``names`` where it is typed invariant.

    A no-op under ``check_vma=False``, where shard_map tracks no such types (a probe of the
    axis index, which is always varying when types are tracked, tells which case this is).
    """
    vma = varying_axes(x)
    if vma is None:
        return x
    missing = tuple(a for a in names if a not in vma)
    if not missing:
        return x
    probe = lax.axis_index(names[0] if len(names) == 1 else names)
    if not set(names) & set(varying_axes(probe) or ()):
        return x
    return lax.pcast(x, missing, to="varying")


def is_rank(ax: Axis, ranks: int | Iterable[int]) -> jax.Array:
    """A traced bool: is this device's rank ``ranks`` (an int) or one of ``ranks``?"""
    if isinstance(ranks, (int, np.integer)):
        return ax.rank() == ranks
    mask = np.zeros(ax.size, dtype=bool)
    mask[list(ranks)] = True
    return lax.dynamic_index_in_dim(jnp.asarray(mask), ax.rank(), 0, keepdims=False)


def tree_broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    """Binomial-tree broadcast from ``src``: ceil(log2 n) ``ppermute`` steps, bit-exact.

    In step k every rank that already holds the value (relative rank v < 2**k) sends it to
    relative rank v + 2**k.
    """
    n = ax.size
    x = ensure_varying(x, ax)
    step = 1
    while step < n:
        pairs = [((src + v) % n, (src + v + step) % n) for v in range(step) if v + step < n]
        received = lax.ppermute(x, ax.name, perm=pairs)
        x = jnp.where(is_rank(ax, [d for _, d in pairs]), received, x)
        step *= 2
    return x


@staged(1, 2)
def native_broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    """Collective-broadcast (NCCL) on GPU; the ppermute tree where XLA has no lowering."""
    if ax.size == 1:
        return x
    x = ensure_varying(x, ax)

    # jax's transpose rule for pbroadcast fails on non-scalar values (jax 0.10), and transposing
    # platform_dependent transposes every branch, on every platform. So the native branch routes
    # its tangent through the ppermute tree: reverse mode then transposes the tree (a binomial
    # reduce of the cotangents onto src) and never reaches the faulty rule.
    names = ax.name if isinstance(ax.name, tuple) else (ax.name,)  # pbroadcast iterates a str

    @jax.custom_jvp
    def _hlo(v):
        return lax.pbroadcast(v, names, src)

    @_hlo.defjvp
    def _hlo_jvp(primals, tangents):
        (v,), (t,) = primals, tangents
        return _hlo(v), tree_broadcast(t, ax, src)

    def _tree(v):
        return tree_broadcast(v, ax, src)

    return lax.platform_dependent(x, cuda=_hlo, rocm=_hlo, default=_tree)


def reduce_scatter_leading(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """``x`` has shape ``(n, *s)``; return ``op`` over ranks of row ``rank``, shape ``s``.

    One ``all_to_all`` brings row r of every rank to rank r; one local XLA reduce folds them.
    Each chunk is reduced once, on one rank, so everyone who later receives it sees the same bits.
    """
    n = ax.size
    if n == 1:
        return fold(op, kind, x)
    rows = lax.all_to_all(x, ax.name, 0, 0, tiled=False)
    return fold(op, kind, rows)


def generic_all_reduce(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """All-reduce for ops lax has no collective for: reduce-scatter (all_to_all + local fold)
    then ``all_gather``. Bandwidth-optimal (each rank sends 2(n-1)/n of x), exact for every op.
    """
    n = ax.size
    if n == 1:
        return x
    shape, size = x.shape, x.size
    m = -(-size // n)  # ceil
    flat = jnp.ravel(x)
    if m * n != size:
        flat = jnp.concatenate([flat, jnp.zeros((m * n - size,), x.dtype)])
    part = reduce_scatter_leading(flat.reshape(n, m), ax, op, kind)
    full = lax.all_gather(part, ax.name, axis=0, tiled=True)
    return full[:size].reshape(shape)


def split_leading(x: jax.Array, axis: int, n: int, tiled: bool) -> jax.Array:
    """Bring the ``n`` slices of ``x`` along ``axis`` to a new leading axis of size ``n``.

    Untiled: ``x.shape[axis] == n`` and each slice drops that axis. Tiled: each slice keeps it,
    with ``x.shape[axis] // n`` entries.
    """
    x = jnp.moveaxis(x, axis, 0)
    if tiled:
        x = x.reshape((n, x.shape[0] // n) + x.shape[1:])
    return x


def unsplit_slice(y: jax.Array, axis: int, tiled: bool) -> jax.Array:
    """Inverse of :func:`split_leading` for one slice (leading axis already removed)."""
    return jnp.moveaxis(y, 0, axis) if tiled else y
