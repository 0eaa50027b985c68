"""The native lowering of ``ragged_all_to_all``: each rank sends its rows in runs of
variable size. On GPUs one HLO ragged-all-to-all; elsewhere (and in a program also lowered
for the CPU) a padded all-to-all of the rows as bytes
(:func:`~jaxcoll._core.lowering.register_gpu_or_portable`), with its own JVP, transpose and
batching rules.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._jax import (
    Primitive,
    Zero,
    instantiate_zeros,
    primitive_batchers,
    primitive_jvps,
    primitive_transposes,
)
from .axis import Axis
from .lowering import all_gather, register_gpu_or_portable, staged
from .vma import ensure_varying


@staged(1, 2, 3)
def ragged_plan(send: jax.Array, ax: Axis, m: int, out_size: int) -> tuple[jax.Array, ...]:
    """The offsets and sizes of a packed ragged all_to_all, clipped to what fits.

    ``send[j]`` rows go to rank j, taken in rank order from the front of an ``m``-row buffer
    (negative sizes count as 0, rows past ``m`` are not sent); each receiver packs what it
    gets in sender order into ``out_size`` rows and drops what does not fit. One all_gather
    of every rank's sizes (n*n int32) lets each rank work out the whole exchange. Returns
    ``(in_off, send, out_off, recv, recv_off, back_off)``: lax.ragged_all_to_all's four
    operands (``out_off[j]``: where my rows land on rank j), where each sender's rows land
    here, and where the rows I received from rank j came from in its buffer (``back_off[j]``:
    where they land when sent back, :func:`reverse`), all from the one exchange of sizes.
    """
    end = jnp.minimum(jnp.cumsum(jnp.maximum(send.astype(jnp.int32), 0)), m)
    in_off = jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]])
    sizes = all_gather(end - in_off, ax).T  # sizes[r, j]: rows rank j sends to rank r
    off = jnp.minimum(jnp.cumsum(sizes, axis=1) - sizes, out_size)
    kept = jnp.minimum(jnp.cumsum(sizes, axis=1), out_size) - off
    r = ax.rank()
    back = jnp.cumsum(sizes, axis=0) - sizes  # back[r, j]: rank j's in_off for rank r
    return in_off, kept[:, r], off[:, r], kept[r], off[r], back[r]


def reverse(plan: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """The plan that sends every received row back to where it came from (the transpose's),
    with no exchange: each rank returns what it kept, in sender order, into the sender's
    buffer at the rows it was sent from."""
    in_off, send, out_off, recv, recv_off, back_off = plan
    return recv_off, recv, back_off, send, in_off, out_off


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

    def run(*args, ax, out_size, count, rows):
        leaves, plan = args[:count], args[count : count + 5]
        flat = [_to_bytes(leaf) for leaf in leaves]
        widths = [f.shape[1] for f in flat]
        moved = lowering_fn(
            jnp.concatenate(flat, axis=1), *plan, ax=ax, out_size=out_size, rows=rows
        )
        cuts = np.cumsum(widths)[:-1].tolist()
        return [
            _from_bytes(part, jax.typeof(leaf))
            for part, leaf in zip(jnp.split(moved, cuts, axis=1), leaves, strict=True)
        ]

    return run


def _ragged_padded(x, in_off, send, out_off, recv, recv_off, *, ax, out_size, rows=None):
    """Where XLA has no ragged all-to-all (CPU; vmap): every sender fills ``n`` chunks of
    ``min(m, out_size, rows)`` rows (zeros past ``send[j]``), one ``lax.all_to_all`` moves
    them, and a scatter-add puts chunk j's first ``recv[j]`` rows at ``recv_off[j]``. Moves
    ``n * min(m, out_size, rows)`` rows per rank whatever the sizes: correct, not lean.
    ``rows``: the most rows any rank sends to any one rank, which the caller guarantees."""
    del out_off
    m, rest = x.shape[0], x.shape[1:]
    cap = min(m, out_size, m if rows is None else rows)
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


def _ragged_native(x, in_off, send, out_off, recv, recv_off, *, ax, out_size, rows=None):
    """GPU: one ``lax.ragged_all_to_all`` (HLO ragged-all-to-all) into a zero buffer."""
    if min(x.shape[0], out_size) == 0 or ax.size == 1:  # nothing to move between devices
        return _ragged_padded(
            x, in_off, send, out_off, recv, recv_off, ax=ax, out_size=out_size, rows=rows
        )
    out = ensure_varying(jnp.zeros((out_size, *x.shape[1:]), x.dtype), ax)
    return lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name=ax.name)


# One primitive over all leaves of a pytree (packed as bytes: one transfer), lowered as
# broadcast_p is (native on GPU-only modules): XLA:CPU has no ragged-all-to-all ("not supported
# by XLA:CPU ThunkEmitter" in jax 0.10) and vmap has no batching rule for it. Linear in the
# leaves; its transpose is the ragged all-to-all back to where each row came from.
ragged_p = Primitive("jaxcoll_ragged_all_to_all")
ragged_p.multiple_results = True
ragged_p.def_abstract_eval(
    lambda *avals, ax, out_size, count, rows: [
        a.update(shape=(out_size, *a.shape[1:])) for a in avals[:count]
    ]
)
register_gpu_or_portable(
    ragged_p, _packed(_ragged_native), _packed(_ragged_padded), multiple_results=True
)


def _ragged_jvp(primals, tangents, *, ax, out_size, count, rows):
    out = ragged_p.bind(*primals, ax=ax, out_size=out_size, count=count, rows=rows)
    # Only the float leaves have tangents (an int leaf beside them, an MoE's expert ids,
    # has float0 ones): they move alone, the others' tangents are symbolic zeros.
    diff = [i for i in range(count) if jnp.issubdtype(primals[i].dtype, jnp.inexact)]
    ts = [instantiate_zeros(tangents[i]) for i in diff]
    moved = (
        ragged_p.bind(*ts, *primals[count:], ax=ax, out_size=out_size, count=len(ts), rows=rows)
        if ts
        else []
    )
    out_t: list[Any] = [Zero(jax.typeof(o).to_tangent_aval()) for o in out]
    for i, t in zip(diff, moved, strict=True):
        out_t[i] = t
    return out, out_t


def _ragged_transpose(cts, *args, ax, out_size, count, rows):
    leaves, plan = args[:count], args[count:]
    cts = [ensure_varying(instantiate_zeros(ct), ax) for ct in cts]
    back = ragged_p.bind(
        *cts, *reverse(plan), ax=ax, out_size=leaves[0].aval.shape[0], count=count, rows=rows
    )
    return [*back, *([None] * len(plan))]


def _ragged_batcher(vals, dims, *, ax, out_size, count, rows):
    """A vmap over another axis: one ragged all-to-all per batch entry."""
    size = next(v.shape[d] for v, d in zip(vals, dims) if d is not None)
    vals = [
        jnp.moveaxis(v, d, 0) if d is not None else jnp.broadcast_to(v, (size, *v.shape))
        for v, d in zip(vals, dims)
    ]
    outs = [
        ragged_p.bind(*(v[b] for v in vals), ax=ax, out_size=out_size, count=count, rows=rows)
        for b in range(size)
    ]
    return [jnp.stack(o) for o in zip(*outs)], [0] * count


primitive_jvps[ragged_p] = _ragged_jvp
primitive_transposes[ragged_p] = _ragged_transpose
primitive_batchers[ragged_p] = _ragged_batcher


def ragged_all_to_all(
    leaves: list[jax.Array],
    ax: Axis,
    plan: tuple[jax.Array, ...],
    out_size: int,
    rows: int | None = None,
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
        return [
            _ragged_padded(leaf, *plan[:5], ax=ax, out_size=out_size, rows=rows) for leaf in leaves
        ]
    return ragged_p.bind(*leaves, *plan, ax=ax, out_size=out_size, count=len(leaves), rows=rows)
