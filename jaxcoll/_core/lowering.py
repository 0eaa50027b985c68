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
    instantiate_zeros,
    lower_fun,
    lowering_platforms,
    primitive_batchers,
    primitive_jvps,
    primitive_transposes,
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
def all_gather(x: jax.Array, ax: Axis, axis: int = 0, tiled: bool = False) -> jax.Array:
    """``lax.all_gather``, typed invariant (every rank holds the same result) when types are
    tracked. One HLO all-gather."""
    if ax.size == 1:  # one rank: every rank holds the same, typed so (as lax.psum types it)
        return replicated(x if tiled else jnp.expand_dims(x, axis), ax)
    x = ensure_varying(x, ax)
    to = "invarying" if types_tracked(names_of(ax)) else "varying"
    return lax.all_gather(x, ax.name, axis=axis, tiled=tiled, to=to)


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
    return from_rows(all_gather(part, ax, axis=0, tiled=False), x)


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
def gather(x: jax.Array, ax: Axis, dst: int, axis: int, tiled: bool) -> jax.Array:
    """``lax.all_gather`` then a select on the rank: zeros off ``dst``."""
    g = all_gather(x, ax, axis, tiled)
    return jnp.where(is_rank(ax, dst), g, jnp.zeros_like(g))


@staged(1, 2, 3, 4)
def scatter(x: jax.Array, ax: Axis, src: int, axis: int, tiled: bool) -> jax.Array:
    """One ``lax.all_to_all``; the row that came from ``src`` is kept."""
    n = ax.size
    parts = split_leading(x, axis, n, tiled)
    if n == 1:
        return unsplit_slice(parts[0], axis, tiled)
    rows = lax.all_to_all(parts, ax.name, 0, 0, tiled=False)  # rows[j] = slice r of rank j
    return unsplit_slice(rows[src], axis, tiled)


@staged(1, 2, 3, 4)
def all_to_all(x: jax.Array, ax: Axis, split_axis: int, concat_axis: int, tiled: bool) -> jax.Array:
    """One ``lax.all_to_all``. Untiled, it is written as the tiled primitive over an inserted
    unit axis: in jax 0.10 the transpose of an untiled all_to_all with ``split_axis !=
    concat_axis`` inserts the unit axis a second time and fails with a cotangent shape error."""
    if tiled or split_axis == concat_axis:
        return lax.all_to_all(x, ax.name, split_axis, concat_axis, tiled=True)
    if split_axis < concat_axis:
        concat_axis += 1
    else:
        split_axis += 1
    y = jnp.expand_dims(x, concat_axis)
    out = lax.all_to_all(y, ax.name, split_axis, concat_axis, tiled=True)
    return jnp.squeeze(out, split_axis)


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


# ------------------------------------------------------------------------ ragged all-to-all
def _column(v: jax.Array, ax: Axis) -> jax.Array:
    """Entry j of the result is entry ``rank`` of rank j's ``v``: a transpose of the ranks'
    small int vectors, done as one all_gather of n*n ints (XLA:CPU compiles an all-gather
    about ten times faster than an all-to-all)."""
    return all_gather(v, ax)[:, ax.rank()]


@staged(1, 2, 3)
def ragged_plan(send: jax.Array, ax: Axis, m: int, out_size: int) -> tuple[jax.Array, ...]:
    """The offsets and sizes of a packed ragged all_to_all, clipped to what fits.

    ``send[j]`` rows go to rank j, taken in rank order from the front of an ``m``-row buffer
    (negative sizes count as 0, rows past ``m`` are not sent); each receiver packs what it
    gets in sender order into ``out_size`` rows and drops what does not fit. One all_gather
    of every rank's sizes (n*n int32) lets each rank work out the whole exchange. Returns
    ``(in_off, send, out_off, recv, recv_off)``: lax.ragged_all_to_all's four operands
    (``out_off[j]``: where my rows land on rank j) plus where each sender's rows land here.
    """
    end = jnp.minimum(jnp.cumsum(jnp.maximum(send.astype(jnp.int32), 0)), m)
    in_off = jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]])
    sizes = all_gather(end - in_off, ax).T  # sizes[r, j]: rows rank j sends to rank r
    off = jnp.minimum(jnp.cumsum(sizes, axis=1) - sizes, out_size)
    kept = jnp.minimum(jnp.cumsum(sizes, axis=1), out_size) - off
    r = ax.rank()
    return in_off, kept[:, r], off[:, r], kept[r], off[r]


def _to_bytes(x: jax.Array) -> jax.Array:
    """``(m, *s)`` of any dtype as ``(m, k)`` uint8, bit for bit."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    elif jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype != jnp.uint8:
        x = lax.bitcast_convert_type(x, jnp.uint8)
    return x.reshape(x.shape[0], -1)


def _from_bytes(b: jax.Array, like: Any) -> jax.Array:
    """Inverse of :func:`_to_bytes` for rows shaped like ``like`` (an aval)."""
    shape, dtype = (b.shape[0], *like.shape[1:]), like.dtype
    if dtype == jnp.bool_:
        return b.reshape(shape).astype(jnp.bool_)
    real = jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.complexfloating) else dtype
    cplx = real != dtype
    width = np.dtype(real).itemsize
    v = b.reshape(shape + ((2,) if cplx else ()) + ((width,) if width > 1 else ()))
    v = lax.bitcast_convert_type(v, real) if real != jnp.uint8 else v
    return lax.complex(v[..., 0], v[..., 1]) if cplx else v


def _packed(lowering_fn):
    """Run a one-buffer lowering on every leaf at once: leaves as bytes, side by side."""

    def run(*args, ax, out_size, count):
        leaves, plan = args[:count], args[count:]
        flat = [_to_bytes(leaf) for leaf in leaves]
        widths = [f.shape[1] for f in flat]
        moved = lowering_fn(jnp.concatenate(flat, axis=1), *plan, ax=ax, out_size=out_size)
        cuts = np.cumsum(widths)[:-1].tolist()
        return [
            _from_bytes(part, jax.typeof(leaf))
            for part, leaf in zip(jnp.split(moved, cuts, axis=1), leaves, strict=True)
        ]

    return run


def _ragged_padded(x, in_off, send, out_off, recv, recv_off, *, ax, out_size):
    """Where XLA has no ragged all-to-all (CPU; vmap): every sender fills ``n`` chunks of
    ``min(m, out_size)`` rows (zeros past ``send[j]``), one ``lax.all_to_all`` moves them, and
    a scatter-add puts chunk j's first ``recv[j]`` rows at ``recv_off[j]``. Moves
    ``n * min(m, out_size)`` rows per rank whatever the sizes: correct, not lean."""
    del out_off
    m, rest = x.shape[0], x.shape[1:]
    cap = min(m, out_size)
    out = ensure_varying(jnp.zeros((out_size, *rest), x.dtype), ax)
    if cap == 0:
        return out
    c = jnp.arange(cap, dtype=jnp.int32)
    take = jnp.clip(in_off[:, None] + c, 0, m - 1)
    keep = (c < send[:, None]).reshape((ax.size, cap) + (1,) * len(rest))
    chunks = jnp.where(keep, x[take], jnp.zeros((), x.dtype))  # (n, cap, *rest)
    got = chunks if ax.size == 1 else lax.all_to_all(chunks, ax.name, 0, 0, tiled=True)
    pos = jnp.where(c < recv[:, None], recv_off[:, None] + c, out_size)  # out of range: dropped
    return out.at[pos].add(got, mode="drop")


def _ragged_native(x, in_off, send, out_off, recv, recv_off, *, ax, out_size):
    """GPU: one ``lax.ragged_all_to_all`` (HLO ragged-all-to-all) into a zero buffer."""
    if min(x.shape[0], out_size) == 0 or ax.size == 1:  # nothing to move between devices
        return _ragged_padded(x, in_off, send, out_off, recv, recv_off, ax=ax, out_size=out_size)
    out = ensure_varying(jnp.zeros((out_size, *x.shape[1:]), x.dtype), ax)
    return lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name=ax.name)


# One primitive over all leaves of a pytree (packed as bytes: one transfer), lowered as
# broadcast_p is (native on GPU-only modules): XLA:CPU has no ragged-all-to-all ("not supported
# by XLA:CPU ThunkEmitter" in jax 0.10) and vmap has no batching rule for it. Linear in the
# leaves; its transpose is the ragged all-to-all back to where each row came from.
ragged_p = Primitive("jaxcoll_ragged_all_to_all")
ragged_p.multiple_results = True
ragged_p.def_abstract_eval(
    lambda *avals, ax, out_size, count: [
        a.update(shape=(out_size, *a.shape[1:])) for a in avals[:count]
    ]
)
register_gpu_or_portable(
    ragged_p, _packed(_ragged_native), _packed(_ragged_padded), multiple_results=True
)


def _ragged_jvp(primals, tangents, *, ax, out_size, count):
    out = ragged_p.bind(*primals, ax=ax, out_size=out_size, count=count)
    ts = [instantiate_zeros(t) for t in tangents[:count]]
    return out, ragged_p.bind(*ts, *primals[count:], ax=ax, out_size=out_size, count=count)


def _ragged_transpose(cts, *args, ax, out_size, count):
    leaves, (in_off, send, _, recv, recv_off) = args[:count], args[count:]
    cts = [ensure_varying(instantiate_zeros(ct), ax) for ct in cts]
    back = ragged_p.bind(
        *cts,
        recv_off,
        recv,
        _column(in_off, ax),
        send,
        in_off,
        ax=ax,
        out_size=leaves[0].aval.shape[0],
        count=count,
    )
    return [*back, None, None, None, None, None]


def _ragged_batcher(vals, dims, *, ax, out_size, count):
    """A vmap over another axis: one ragged all-to-all per batch entry."""
    size = next(v.shape[d] for v, d in zip(vals, dims) if d is not None)
    vals = [
        jnp.moveaxis(v, d, 0) if d is not None else jnp.broadcast_to(v, (size, *v.shape))
        for v, d in zip(vals, dims)
    ]
    outs = [
        ragged_p.bind(*(v[b] for v in vals), ax=ax, out_size=out_size, count=count)
        for b in range(size)
    ]
    return [jnp.stack(o) for o in zip(*outs)], [0] * count


primitive_jvps[ragged_p] = _ragged_jvp
primitive_transposes[ragged_p] = _ragged_transpose
primitive_batchers[ragged_p] = _ragged_batcher


def ragged_all_to_all(
    leaves: list[jax.Array], ax: Axis, plan: tuple[jax.Array, ...], out_size: int
) -> list[jax.Array]:
    """Move the leaves (one leading row count) by ``plan`` (from :func:`ragged_plan`) into
    ``out_size`` rows each, all leaves in one transfer.

    GPU: one ``lax.ragged_all_to_all``; elsewhere, and in a module lowered for a GPU and a CPU
    at once (see :func:`register_gpu_or_portable`), :func:`_ragged_padded` (also what a vmapped
    axis runs, called directly per leaf: vmap's all_to_all batches, ragged-all-to-all does
    not).
    """
    leaves = [ensure_varying(leaf, ax) for leaf in leaves]
    plan = tuple(ensure_varying(p, ax) for p in plan)
    if ax.vmapped:  # per leaf: jax differentiates this path itself, and bitcasts have no grad
        return [_ragged_padded(leaf, *plan, ax=ax, out_size=out_size) for leaf in leaves]
    return ragged_p.bind(*leaves, *plan, ax=ax, out_size=out_size, count=len(leaves))


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
