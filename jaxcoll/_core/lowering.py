"""The native per-leaf lowerings: one lax collective per op wherever lax has one.

Every function here works on one validated array leaf and a resolved
:class:`~jaxcoll._core.axis.Axis`; the public primitives validate, choose an algorithm and call
these for ``algorithm="native"``. Where lax lacks an op (rooted ops, PRODUCT and bitwise
reductions, a CPU broadcast) the pattern is built from differentiable lax ops, so ``jax.grad``
of a pattern is the transpose of the pattern. Results equal on every rank are typed invariant
(all_reduce, broadcast, all_gather), so ``shard_map``'s checking holds with ``out_specs=P()``.

Two ops have a GPU-only HLO (collective-broadcast, ragged-all-to-all). Their primitives use it
only when every platform the module is lowered for is a GPU, so a program exported for
``("cuda", "cpu")`` also runs on the CPU (:func:`register_gpu_or_portable`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._jax import (
    Primitive,
    deflinear2,
    fancy_primitive_batchers,
    lower_fun,
    lowering_platforms,
    register_lowering,
)
from .axis import Axis, is_rank, permute
from .ops import ReduceOp, fold, rule
from .packing import from_rows, split_leading, to_rows, unsplit_slice
from .vma import _without, ensure_varying, replicated, root_cotangent, types_tracked


def staged(*static_argnums: int):
    """Compile a per-leaf lowering as one unit, with its axis/op arguments static.

    Under ``jax.jit`` this changes nothing (the call is inlined). Under an eager ``shard_map``,
    which dispatches and compiles every op it meets, a collective then costs one compiled
    program instead of one per reshape, select and fold inside it.
    """
    return functools.partial(jax.jit, static_argnums=static_argnums)


def names_of(ax: Axis) -> tuple:
    """``ax.name`` as a tuple (some lax collectives iterate a plain string name)."""
    return ax.name if isinstance(ax.name, tuple) else (ax.name,)


GPU_PLATFORMS = ("cuda", "rocm")
"""Platforms whose XLA compiles HLO collective-broadcast and ragged-all-to-all."""


def register_gpu_or_portable(
    prim: Primitive, gpu: Any, portable: Any, *, multiple_results: bool
) -> None:
    """Lower ``prim`` by ``gpu`` when every platform of the module is a GPU, else ``portable``.

    One rule that looks at all the platforms the module is lowered for, not one rule per
    platform: per-platform rules make a module exported for ``("cuda", "cpu")`` a ``case`` on
    the platform index with the GPU op in one branch. JAX resolves that index before
    compiling, but not inside a ``shard_map`` body (an ``sdy.manual_computation`` takes it as
    an operand), so XLA:CPU compiles the GPU branch too and fails (``UNIMPLEMENTED: HLO opcode
    collective-broadcast is not supported by XLA:CPU ThunkEmitter``, jax 0.10.2 and 0.11.2).
    The cost: such a module runs the portable lowering on the GPU as well; a module lowered for
    GPUs only (``jax.jit`` on a GPU, ``jax.export(..., platforms=("cuda",))``) gets ``gpu``.
    """
    rules = {
        True: lower_fun(gpu, multiple_results=multiple_results),
        False: lower_fun(portable, multiple_results=multiple_results),
    }

    def rule(ctx, *args, **params):
        native = all(p in GPU_PLATFORMS for p in lowering_platforms(ctx))
        return rules[native](ctx, *args, **params)

    register_lowering(prim, rule)


# ------------------------------------------------------------------------------ all-gather
@staged(1, 2, 3)
def all_gather(x: jax.Array, ax: Axis, dim: int = 0, tiled: bool = False) -> jax.Array:
    """``lax.all_gather``, typed invariant (every rank holds the same result) when types are
    tracked. One HLO all-gather."""
    if ax.size == 1:  # one rank: every rank holds the same, typed so (as lax.psum types it)
        return replicated(x if tiled else jnp.expand_dims(x, dim), ax)
    x = ensure_varying(x, ax)
    to = "invarying" if types_tracked(names_of(ax)) else "varying"
    return lax.all_gather(x, ax.name, axis=dim, tiled=tiled, to=to)


# ------------------------------------------------------------------------------ all-reduce
def reduce_scatter_leading(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """``x`` has shape ``(n, *s)``; return ``op`` over ranks of row ``rank``, shape ``s``.

    One ``all_to_all`` brings row r of every rank to rank r; one local XLA reduce folds them.
    Each chunk is reduced once, on one rank, so everyone who later receives it sees the same bits.
    """
    if ax.size == 1:
        return fold(op, kind, x)
    rows = lax.all_to_all(ensure_varying(x, ax), ax.name, 0, 0, tiled=False)
    return fold(op, kind, rows)


def generic_all_reduce(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """All-reduce for ops lax has no collective for: reduce-scatter (all_to_all + local fold)
    then an invariant ``all_gather``. Each rank sends 2(n-1)/n of x; exact for every op."""
    n = ax.size
    if n == 1:
        return x
    part = reduce_scatter_leading(to_rows(x, n), ax, op, kind)
    return from_rows(all_gather(part, ax, dim=0, tiled=False), x)


def _ordered_key(x: jax.Array, nan_first: bool) -> tuple[jax.Array, Any]:
    """Float bits as signed integers in the float order, NaN beyond every number.

    Positive floats keep their bits; negative ones flip their magnitude bits, so integer order
    is float order (-inf < ... < -0 < +0 < ... < +inf). Every NaN becomes the one NaN that
    sorts above +inf (``nan_first=False``: for MAX) or below -inf (for MIN), so a native
    integer pmax/pmin propagates NaN as ``jnp.maximum`` does. Returns the keys and the map back.
    """
    width = jnp.dtype(x.dtype).itemsize
    sint = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[width]
    mask = jnp.asarray(np.iinfo(sint).max, sint)  # every bit but the sign

    def key(v):
        b = lax.bitcast_convert_type(v, sint)
        return jnp.where(b < 0, b ^ mask, b)

    nan = jnp.asarray(-jnp.nan if nan_first else jnp.nan, x.dtype)
    k = key(jnp.where(jnp.isnan(x), nan, x))

    def back(k):
        return lax.bitcast_convert_type(jnp.where(k < 0, k ^ mask, k), x.dtype)

    return k, back


@staged(1, 2, 3)
def all_reduce(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    """All-reduce one leaf: the op's native lax collective, or :func:`generic_all_reduce`.

    Float MIN/MAX run as an integer pmin/pmax of order-preserving keys: one all-reduce that
    propagates NaN on every platform (XLA:CPU's float pmax/pmin drop it: 8 ranks, NaN on
    rank 3 gave 7.), bit-exact otherwise.
    """
    if ax.size == 1:  # one rank: typed invariant, as lax.psum over one device types it
        return replicated(x, ax)
    native = rule(op, kind).native
    if native is None:
        return generic_all_reduce(x, ax, op, kind)
    if kind == "floating" and op in (ReduceOp.MIN, ReduceOp.MAX):
        k, back = _ordered_key(x, nan_first=op is ReduceOp.MIN)
        return back(native(k, ax.name))
    return native(x, ax.name)


@staged(1, 2, 3, 4)
def reduce(x: jax.Array, ax: Axis, dst: int, op: ReduceOp, kind: str) -> jax.Array:
    """Reduce one leaf to ``dst`` (all-reduce, then keep x off ``dst``)."""
    return jnp.where(is_rank(ax, dst), all_reduce(x, ax, op, kind), x)


@staged(1, 2, 3, 4, 5)
def reduce_scatter(
    x: jax.Array, ax: Axis, op: ReduceOp, kind: str, dim: int, tiled: bool
) -> jax.Array:
    """SUM/AVG on numbers: one ``lax.psum_scatter`` (AVG then divides); every other op and
    bool: one ``all_to_all`` + one local reduce."""
    n = ax.size
    if x.size == 0:  # XLA rejects an empty scattered dimension; there is nothing to reduce
        return unsplit_slice(jnp.zeros_like(split_leading(x, dim, n, tiled)[0]), dim, tiled)
    if kind != "bool" and op in (ReduceOp.SUM, ReduceOp.AVG):
        out = (
            lax.psum_scatter(x, ax.name, scatter_dimension=dim, tiled=tiled)
            if n > 1
            else (x if tiled else jnp.squeeze(x, dim))
        )
        if op is ReduceOp.AVG:
            out = (out / jnp.asarray(n, out.dtype)).astype(out.dtype)
        return out
    parts = split_leading(x, dim, n, tiled)
    return unsplit_slice(reduce_scatter_leading(parts, ax, op, kind), dim, tiled)


# ------------------------------------------------------------------------------- broadcast
def tree_broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    """Binomial-tree broadcast from ``src``: ceil(log2 n) ``ppermute`` steps, bit-exact.

    In step k every rank that already holds the value (relative rank v < 2**k) sends it to
    relative rank v + 2**k. Typed as jax types ppermute: varying.
    """
    n = ax.size
    x = ensure_varying(x, ax)
    step = 1
    while step < n:
        pairs = [((src + v) % n, (src + v + step) % n) for v in range(step) if v + step < n]
        received = permute(x, ax, pairs)
        x = jnp.where(is_rank(ax, [d for _, d in pairs]), received, x)
        step *= 2
    return x


# One primitive for the broadcast, lowered by what every platform of the module can compile
# (register_gpu_or_portable): NCCL's broadcast for GPUs alone, the tree otherwise. Not
# ``lax.platform_dependent``: it lowers the GPU-only branch for the CPU too. Its result is
# typed invariant; its transpose hands the (invariant) cotangent to ``src``, so no broken
# pbroadcast transpose rule is ever reached.
broadcast_p = Primitive("jaxcoll_broadcast")
broadcast_p.def_abstract_eval(lambda aval, *, ax, src: _without(aval, names_of(ax)))


def _broadcast_gpu(x, *, ax, src):
    return lax.pbroadcast(x, names_of(ax), src)  # NCCL broadcast (HLO collective-broadcast)


def _broadcast_tree(x, *, ax, src):
    return tree_broadcast(x, ax, src)


register_gpu_or_portable(broadcast_p, _broadcast_gpu, _broadcast_tree, multiple_results=False)
deflinear2(broadcast_p, lambda ct, x, *, ax, src: [root_cotangent(ct, names_of(ax), src)])


@staged(1, 2)
def broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    """Collective-broadcast (NCCL) on GPU; the ppermute tree where XLA has none (CPU, TPU) and
    in a module lowered for a GPU and such a platform at once."""
    if ax.size == 1:
        return replicated(x, ax)
    return broadcast_p.bind(ensure_varying(x, ax), ax=ax, src=src)


# ------------------------------------------------------------------- rooted and one-to-one
@staged(1, 2, 3, 4)
def gather(x: jax.Array, ax: Axis, dst: int, dim: int, tiled: bool) -> jax.Array:
    """``lax.all_gather`` then a select on the rank: zeros off ``dst``."""
    g = all_gather(x, ax, dim, tiled)
    return jnp.where(is_rank(ax, dst), g, jnp.zeros_like(g))


@staged(1, 2, 3, 4)
def scatter(x: jax.Array, ax: Axis, src: int, dim: int, tiled: bool) -> jax.Array:
    """One ``lax.all_to_all``; the row that came from ``src`` is kept."""
    n = ax.size
    parts = split_leading(x, dim, n, tiled)
    if n == 1:
        return unsplit_slice(parts[0], dim, tiled)
    rows = lax.all_to_all(parts, ax.name, 0, 0, tiled=False)  # rows[j] = slice r of rank j
    return unsplit_slice(rows[src], dim, tiled)


@staged(1, 2, 3, 4)
def all_to_all(x: jax.Array, ax: Axis, split_dim: int, concat_dim: int, tiled: bool) -> jax.Array:
    """One ``lax.all_to_all``. Untiled, it is written as the tiled primitive over an inserted
    unit dimension: in jax 0.10 the transpose of an untiled all_to_all with ``split_dim !=
    concat_dim`` inserts the unit dimension a second time and fails with a cotangent shape
    error."""
    if tiled or split_dim == concat_dim:
        return lax.all_to_all(x, ax.name, split_dim, concat_dim, tiled=True)
    if split_dim < concat_dim:
        concat_dim += 1
    else:
        split_dim += 1
    y = jnp.expand_dims(x, concat_dim)
    out = lax.all_to_all(y, ax.name, split_dim, concat_dim, tiled=True)
    return jnp.squeeze(out, split_dim)


@staged(1, 2)
def sendrecv(x: jax.Array, ax: Axis, pairs: tuple[tuple[int, int], ...]) -> jax.Array:
    """One ``lax.ppermute``; ranks that receive nothing keep their own ``x``."""
    x = ensure_varying(x, ax)
    got = permute(x, ax, pairs)
    return jnp.where(is_rank(ax, [d for _, d in pairs]), got, x)


@staged(1, 2)
def shift(x: jax.Array, ax: Axis, offset: int) -> jax.Array:
    """One cyclic ``lax.ppermute``: rank r gets rank ``r - offset``'s value."""
    k = offset % ax.size
    if k == 0:
        return x
    return lax.ppermute(x, ax.name, perm=[(i, (i + k) % ax.size) for i in range(ax.size)])


def _broadcast_batcher(axis_data, vals_in, dims_in, *, ax, src):
    """Under ``jax.vmap(axis_name=...)``: every member takes entry ``src`` of the mapped axis."""
    (v,), (d,) = vals_in, dims_in
    if axis_data.name not in names_of(ax):
        return broadcast_p.bind(v, ax=ax, src=src), d
    if len(names_of(ax)) != 1:
        raise NotImplementedError("broadcast under vmap over a tuple of axis names")
    if d is None:  # not mapped: every member holds the same value already
        return v, d
    picked = lax.index_in_dim(v, src, axis=d, keepdims=True)
    return jnp.broadcast_to(picked, v.shape), d


fancy_primitive_batchers[broadcast_p] = _broadcast_batcher


# -------------------------------------------------------------------- uneven (all-)gather
@staged(2)
def all_gather_uneven(x: jax.Array, size: jax.Array, ax: Axis) -> jax.Array:
    """Zero this rank's rows from ``size`` on, then one invariant ``lax.all_gather``."""
    keep = (jnp.arange(x.shape[0]) < size).reshape((x.shape[0],) + (1,) * (x.ndim - 1))
    return all_gather(jnp.where(keep, x, jnp.zeros((), x.dtype)), ax)


# ------------------------------------------------------------------------- prefix reduction
def identity(op: ReduceOp, kind: str, dtype: Any) -> Any:
    """The value ``e`` with ``op(e, v) == v``: what an empty prefix reduces to."""
    if kind == "bool":
        return op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        lo, hi = (
            (-np.inf, np.inf) if kind == "floating" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
        )
        return hi if op is ReduceOp.MIN else lo
    if op is ReduceOp.PRODUCT:
        return 1
    if op is ReduceOp.BAND:
        return np.iinfo(dtype).max if np.iinfo(dtype).min == 0 else -1
    return 0  # SUM, AVG, BOR, BXOR


@staged(1, 2, 3, 4)
def scan(x: jax.Array, ax: Axis, op: ReduceOp, kind: str, exclusive: bool) -> jax.Array:
    """Hillis-Steele prefix reduction: ceil(log2 n) ``ppermute`` steps of distance 1, 2, 4..

    In the step of distance d every rank r >= d folds in what rank r - d holds, so after k
    steps rank r holds ``op`` over ranks max(0, r - 2**k + 1)..r. ``exclusive`` first shifts
    every value one rank up (one more ppermute; rank 0 starts from the op's identity). AVG
    folds with + and divides by the number of ranks folded (exclusive rank 0: zeros).
    """
    n = ax.size
    r = ax.rank()
    x = ensure_varying(x, ax)
    if exclusive:
        e = jnp.full_like(x, identity(op, kind, x.dtype))
        x = (
            e
            if n == 1
            else jnp.where(r == 0, e, permute(x, ax, [(i, i + 1) for i in range(n - 1)]))
        )
    combine = rule(op, kind).combine
    d = 1
    while d < n:
        got = permute(x, ax, [(i, i + d) for i in range(n - d)])
        x = jnp.where(r >= d, combine(got, x), x)
        d *= 2
    if op is ReduceOp.AVG:
        count = jnp.maximum(r if exclusive else r + 1, 1).astype(x.dtype)
        x = (x / count).astype(x.dtype)
    return x
