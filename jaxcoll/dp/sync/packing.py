"""Sharded collectives by buckets: many leaves' all-gathers (reduce-scatters) as one each.

The sharded strategies (:class:`~jaxcoll.dp.sync.ZeRO1`, :class:`~jaxcoll.dp.sync.FSDP`)
split each param along one dimension, so every step moves every split leaf through an
all-gather or a reduce-scatter of its own. Across processes each collective has a fixed cost
(a gloo round trip, a NCCL launch) that dwarfs the bytes of a medium leaf; torch's FSDP
flattens a module's params into one ``FlatParameter`` for the same reason. Here the leaves of
a bucket (:func:`~jaxcoll.dp.plan_buckets`, DDP's planning by bytes, one dtype per bucket)
travel as one buffer: each leaf's split dimension is moved to the front and the leaf is
reshaped to ``n`` rows (row ``r``: rank ``r``'s contiguous slice), the rows of the bucket's
leaves are concatenated, and one tiled collective moves the ``(n, total)`` buffer. The
values are exactly the per-leaf collectives' (the same sums of the same elements, in the same
rank order); only the number of collectives changes.

Both functions run per rank inside ``jax.shard_map`` (checking on or off) on lists of arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from ... import primitives
from ..._core.typing import AxisName
from ..._core.vma import varying_axes
from .buckets import plan_buckets

__all__ = [
    "gather_leaves",
    "scatter_leaves",
    "sum_leaves",
]


def gather_leaves(
    shards: Sequence[jax.Array],
    dims: Sequence[int],
    axis_name: AxisName,
    *,
    algorithm: str = "auto",
    bucket_bytes: float | None,
    codec: Codec | None = None,
) -> list[jax.Array]:
    """The whole leaves from every rank's slices, one all-gather per bucket.

    Equivalent to (the per-leaf path, which ``bucket_bytes=None`` runs)::

        def gather_leaves(shards, dims, axis_name, *, algorithm, bucket_bytes):
            return [all_gather(x, axis_name, dim=d, tiled=True, algorithm=algorithm)
                    for x, d in zip(shards, dims)]

    Lowering: per bucket of :func:`~jaxcoll.dp.plan_buckets` (planned on the whole leaves'
    bytes, one dtype per bucket), each shard's ``dims[i]`` moved to the front and the shard
    raveled into one row, the rows concatenated into ``(1, total)``, one
    :func:`jaxcoll.primitives.all_gather` (``tiled=True``, axis 0: HLO all-gather with the
    native algorithm) to ``(n, total)``, then each leaf's columns reshaped and its dimension
    moved back. A one-leaf bucket skips the concatenation. Any dtype.

    Args:
        shards: this rank's slice of every leaf: contiguous along ``dims[i]``, rank ``r``
            holding part ``r`` of ``n`` (the whole leaf's ``dims[i]`` is n times the slice's).
        dims: the dimension each leaf is split along (``0 <= dims[i] < shards[i].ndim``).
        axis_name: the mesh axis (or tuple of axes) the leaves are split over.
        algorithm: the all-gather algorithm (:data:`jaxcoll.algorithms.ALGORITHMS`).
        bucket_bytes: bucket size in bytes of whole leaves; None: one all-gather per leaf.
        codec: how a bucket's rows travel (:class:`Codec`: 8-bit blocks with their scales,
            :class:`~jaxcoll.dp.sync.quantized.Blocks`); None: as they are, concatenated.

    Returns:
        The whole leaves, in order: ``shards[i]`` with ``dims[i]`` n times longer, typed
        invariant over ``axis_name`` (the same on every rank: ``out_specs=P()`` checks) and
        varying over any other axis a shard varies over.

    Example (8 devices, inside ``jax.shard_map`` over ``"data"``)::

        >>> w, b = gather_leaves([w_slice, b_slice], [0, 0], "data", bucket_bytes=2**20)
        >>> w.shape[0] == 8 * w_slice.shape[0]   # one all-gather for both
        True
    """
    api = "gather_leaves"
    shards, dims = list(shards), _check(api, "shards", shards, dims)
    n = primitives.world_size(axis_name)
    wholes = [
        jax.ShapeDtypeStruct(_scaled(x.shape, d, n), x.dtype)
        for x, d in zip(shards, dims, strict=True)
    ]
    out: list[Any] = [None] * len(shards)
    codec = codec or _Plain(algorithm)
    for bucket in plan_buckets(wholes, bucket_bytes, [varying_axes(x) for x in shards]):
        rows = [_row(shards[i], dims[i], 1) for i in bucket]
        # Params cross devices here: one all-gather per bucket (the codec's).
        for i, part in zip(bucket, codec.gather(rows, axis_name), strict=True):
            out[i] = _unrow(part, dims[i], wholes[i].shape)
    return out


def scatter_leaves(
    grads: Sequence[jax.Array],
    dims: Sequence[int],
    axis_name: AxisName,
    *,
    algorithm: str = "auto",
    bucket_bytes: float | None,
    wire_dtype: DTypeLike | None = None,
    codec: Codec | None = None,
) -> list[jax.Array]:
    """This rank's slice of the sum over ranks of every leaf, one reduce-scatter per bucket.

    The inverse of :func:`gather_leaves`. Equivalent to (the per-leaf path, which
    ``bucket_bytes=None`` runs)::

        def scatter_leaves(grads, dims, axis_name, *, algorithm, bucket_bytes, wire_dtype):
            return [reduce_scatter(g.astype(wire_dtype or g.dtype), axis_name, "sum",
                                   scatter_dimension=d, tiled=True,
                                   algorithm=algorithm).astype(g.dtype)
                    for g, d in zip(grads, dims)]

    The sum, not the mean: a caller that wants the mean divides each gradient by n first
    (before any cast to ``wire_dtype``), as :class:`~jaxcoll.dp.sync.ZeRO1` does.

    Lowering: per bucket of :func:`~jaxcoll.dp.plan_buckets` (planned on the leaves as they
    travel: in ``wire_dtype`` when given, one dtype per bucket), each leaf cast to the wire
    dtype, its ``dims[i]`` moved to the front and the leaf reshaped to ``(n, m_i)`` (row
    ``r``: rank ``r``'s slice), the rows concatenated into ``(n, total)``, one
    :func:`jaxcoll.primitives.reduce_scatter` (``"sum"``, ``tiled=True``, dimension 0: HLO
    reduce-scatter with the native algorithm) to ``(1, total)``, then each leaf's columns
    reshaped, moved back and cast to the gradient's dtype. Numbers of any dtype
    (:func:`~jaxcoll.primitives.reduce_scatter`'s rules for ``"sum"``).

    Args:
        grads: this rank's whole gradient of every leaf (typed varying over ``axis_name``).
        dims: the dimension each leaf is split along; ``grads[i].shape[dims[i]]`` must be a
            multiple of n.
        axis_name: the mesh axis (or tuple of axes) to reduce over and split along.
        algorithm: the reduce-scatter algorithm (:data:`jaxcoll.algorithms.ALGORITHMS`).
        bucket_bytes: bucket size in bytes; None: one reduce-scatter per leaf.
        wire_dtype: the dtype the buffers travel in (e.g. bfloat16); None: each leaf's own.
        codec: how a bucket's rows travel and are summed (:class:`Codec`; 8-bit blocks
            sent by an all-to-all and summed in float32:
            :class:`~jaxcoll.dp.sync.quantized.Blocks`); None: one reduce-scatter.

    Returns:
        Rank r's slice r (along ``dims[i]``, n times shorter) of the sum over ranks of each
        leaf, in the gradient's dtype, typed varying over ``axis_name`` (each rank its own).

    Example (8 devices, inside ``jax.shard_map`` over ``"data"``)::

        >>> gw, gb = scatter_leaves([g_w / 8, g_b / 8], [0, 0], "data", bucket_bytes=2**20)
        >>> gw.shape[0] == g_w.shape[0] // 8     # this rank's slice of the mean
        True
    """
    api = "scatter_leaves"
    grads, dims = list(grads), _check(api, "grads", grads, dims)
    n = primitives.world_size(axis_name)
    for g, d in zip(grads, dims, strict=True):
        if g.shape[d] % n:
            raise ValueError(
                f"{api}: a gradient of shape {tuple(g.shape)} cannot be split along "
                f"dims={d} over {n} ranks ({g.shape[d]} is not a multiple of {n}); pass a "
                f"dimension whose size n divides."
            )
    wire = [g if wire_dtype is None else g.astype(wire_dtype) for g in grads]
    out: list[Any] = [None] * len(grads)
    codec = codec or _Plain(algorithm)
    for bucket in plan_buckets(wire, bucket_bytes):
        rows = [_row(wire[i], dims[i], n) for i in bucket]
        # Gradients cross devices here: one reduce-scatter per bucket (the codec's), each
        # rank its slice.
        for i, part in zip(bucket, codec.scatter(rows, axis_name), strict=True):
            shape = _scaled(grads[i].shape, dims[i], 1, n)
            out[i] = _unrow(part, dims[i], shape).astype(grads[i].dtype)
    return out


def divides_after(wire_dtype: DTypeLike | None, dtypes: Sequence[Any]) -> bool:
    """Whether a mean's division by n runs on each rank's slice after the sum: when every
    gradient of ``dtypes`` travels in its own dtype (``wire_dtype`` None or that dtype; one
    rounding, 1/n of the bytes); else it runs before the cast, so the sum stays in range."""
    return all(wire_dtype is None or np.dtype(wire_dtype) == np.dtype(dt) for dt in dtypes)


def sum_leaves(
    leaves: Sequence[jax.Array],
    axis_name: AxisName,
    *,
    algorithm: str = "auto",
    bucket_bytes: float | None,
    wire_dtype: DTypeLike | None = None,
) -> list[jax.Array]:
    """Each leaf summed over ``axis_name``, one all-reduce per bucket (hybrid sharding's sum
    of the gradient slices over the replica axes).

    Equivalent to ``[all_reduce(x.astype(wire_dtype or x.dtype), axis_name, "sum",
    algorithm=algorithm).astype(x.dtype) for x in leaves]``; the buckets are
    :func:`~jaxcoll.dp.plan_buckets`'s on the leaves as they travel.

    Returns:
        The sums, in each leaf's dtype, typed invariant over ``axis_name``.
    """
    wire = [x if wire_dtype is None else x.astype(wire_dtype) for x in leaves]
    out: list[Any] = [None] * len(wire)
    for bucket in plan_buckets(wire, bucket_bytes):
        # Gradient slices cross the replica axes here: one all-reduce per bucket.
        sums = primitives.all_reduce(
            [wire[i] for i in bucket], axis_name, "sum", algorithm=algorithm
        )
        for i, s in zip(bucket, sums, strict=True):
            out[i] = s.astype(leaves[i].dtype)
    return out


class Codec(Protocol):
    """How one bucket's rows cross the devices (for :func:`gather_leaves` and
    :func:`scatter_leaves`)."""

    def gather(self, rows: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
        """This rank's rows ``(1, m_i)`` -> every rank's, ``(n, m_i)`` in rank order."""
        ...

    def scatter(self, rows: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
        """This rank's rows ``(n, m_i)`` (row r: rank r's part) -> ``(1, m_i)``, this rank's
        part summed over the ranks."""
        ...


class _Plain:
    """The rows as they are: concatenated, one all-gather or reduce-scatter."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm

    def gather(self, rows: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
        buf = rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)
        buf = primitives.all_gather(buf, axis_name, dim=0, tiled=True, algorithm=self.algorithm)
        return _columns(buf, rows)

    def scatter(self, rows: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
        buf = rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)
        buf = primitives.reduce_scatter(
            buf, axis_name, "sum", scatter_dimension=0, tiled=True, algorithm=self.algorithm
        )
        return _columns(buf, rows)


def _check(api: str, what: str, leaves: Sequence[Any], dims: Sequence[int]) -> list[int]:
    """``dims`` checked against ``leaves``: one valid dimension per leaf."""
    dims = list(dims)
    if len(dims) != len(leaves):
        raise ValueError(
            f"{api}: got {len(leaves)} {what} and {len(dims)} dims; pass one split "
            f"dimension per leaf."
        )
    for x, d in zip(leaves, dims, strict=True):
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{api}: dims must hold ints, got {d!r} instead.")
        if not 0 <= d < x.ndim:
            raise ValueError(
                f"{api}: dims={d} is out of range for a leaf of shape {tuple(x.shape)}; pass "
                f"a dimension in 0..{x.ndim - 1}."
            )
    return [int(d) for d in dims]


def _scaled(shape: tuple[int, ...], d: int, by: int, div: int = 1) -> tuple[int, ...]:
    """``shape`` with dimension ``d`` multiplied by ``by`` and divided by ``div``."""
    return shape[:d] + (shape[d] * by // div,) + shape[d + 1 :]


def _row(x: jax.Array, d: int, n: int) -> jax.Array:
    """``x`` as ``(n, m)``: dimension ``d`` to the front, row ``r`` its ``r``-th of ``n``
    contiguous parts along it."""
    return jnp.moveaxis(x, d, 0).reshape(n, int(np.prod(x.shape)) // n)


def _columns(buf: jax.Array, rows: list[jax.Array]) -> list[jax.Array]:
    """``buf`` cut along its columns into parts as wide as each of ``rows``."""
    if len(rows) == 1:
        return [buf]
    out, start = [], 0
    for r in rows:
        out.append(buf[:, start : start + r.shape[1]])
        start += r.shape[1]
    return out


def _unrow(part: jax.Array, d: int, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`_row`: ``part`` (rows of parts along ``d``, in order) as ``shape``."""
    front = (shape[d],) + shape[:d] + shape[d + 1 :]
    return jnp.moveaxis(part.reshape(front), 0, d)
