"""Gradient synchronisation: the exact global mean, one jaxcoll collective per bucket.

Everything here runs inside ``jax.shard_map`` on *local* gradients: gradients of the local
per-example-mean loss taken with respect to params made varying over the data axis (see the
gradient trap in the README). Each rank holds the same number of examples, so the global
mean is the sum over ranks of ``g_local / n``: every leaf is divided by n exactly once,
before the reduction (as DDP does), and reduced exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import primitives
from .._core.typing import AxisName, PyTree
from ..algorithms import choose
from ..algorithms.registry import check_algorithm

_SYNCED = ("all_reduce", "reduce_scatter", "all_gather")


def algorithm_kwargs(api: str, grad_sync: Any) -> dict[str, dict[str, str]]:
    """The ``algorithm=`` keyword each collective of the gradient sync gets for ``grad_sync``.

    Raises:
        TypeError: ``grad_sync`` is not a string.
        ValueError: ``grad_sync`` is not one of :data:`jaxcoll.algorithms.ALGORITHMS`.
    """
    check_algorithm(api, grad_sync, argname="grad_sync")
    return {name: {"algorithm": grad_sync} for name in _SYNCED}


def plan_buckets(leaves: list[Any], bucket_bytes: float | None) -> list[list[int]]:
    """Group leaf indices into buckets of about ``bucket_bytes`` each, one dtype per bucket.

    Like DDP, leaves are taken in reverse order (the last layer's gradient is ready first in
    a backward pass) and a bucket is closed once it holds ``bucket_bytes`` or more, or when
    the dtype changes. ``bucket_bytes=None`` puts every leaf in its own bucket (bucketing off).
    """
    buckets: list[list[int]] = []
    size = 0.0
    dtype = None
    for i in reversed(range(len(leaves))):
        leaf = leaves[i]
        nbytes = float(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        full = bucket_bytes is None or size >= bucket_bytes
        if not buckets or full or leaf.dtype != dtype:
            buckets.append([])
            size, dtype = 0.0, leaf.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


def mean_gradients(
    grads: PyTree,
    axis_name: AxisName,
    *,
    bucket_bytes: float | None,
    grad_dtype: Any = None,
    algorithm: dict[str, dict[str, str]] | None = None,
) -> PyTree:
    """The mean over ranks of each rank's local gradient, one all-reduce per bucket.

    Equivalent to ``jax.tree.map(lambda g: all_reduce(g, axis_name, "avg"), grads)``. Each
    leaf is divided by n, cast to ``grad_dtype`` when given (e.g. bfloat16, DDP's
    ``bf16_compress_hook``), summed over ranks, and cast back to its own dtype.

    Lowering, per bucket of :func:`plan_buckets`: with the native algorithm (``"native"``, or
    ``"auto"`` where jaxcoll's table picks native) one ``lax.psum`` over the bucket's leaves,
    which XLA's all-reduce combiner turns into ONE all-reduce op per bucket in the compiled
    HLO (no copy into a staging buffer: packing the MLP benchmark's gradients into one flat
    buffer made the step 3-4x slower on CPU); buckets are chained by a data dependency so
    they are never merged with each other. With ``"ring"``, ``"tree"`` or
    ``"hierarchical"`` the leaves are packed into one flat buffer for one
    :func:`jaxcoll.primitives.all_reduce` call with that algorithm.
    """
    n = primitives.world_size(axis_name)
    kwargs = (algorithm or {}).get("all_reduce", {})
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    out: list[Any] = [None] * len(leaves)
    previous: list[int] = []
    for bucket in plan_buckets(leaves, bucket_bytes):
        parts = [leaves[i] for i in bucket]
        dtype = parts[0].dtype
        wire = [(p / jnp.asarray(n, dtype)).astype(grad_dtype or dtype) for p in parts]
        if previous:
            # Order the buckets (as DDP launches them): a zero taken from every leaf of the
            # last bucket's result makes this bucket's reduction depend on it, so XLA's
            # all-reduce combiner merges the leaves of a bucket into one all-reduce op but
            # never merges two buckets.
            zero = sum(jnp.ravel(out[i])[0] for i in previous).astype(wire[0].dtype) * 0
            wire = [w + zero for w in wire]  # fused into the division above: no extra pass
        # Gradients cross devices here: one collective per bucket.
        summed = _sum_bucket(wire, axis_name, n, kwargs)
        for i, total in zip(bucket, summed, strict=True):
            out[i] = total.astype(dtype)
        previous = bucket
    return jax.tree_util.tree_unflatten(treedef, out)


def _resolve(kwargs: dict[str, str], nbytes: int, axis_name: AxisName, n: int) -> str:
    name = kwargs.get("algorithm", "native")
    if name != "auto":
        return name
    return choose("all_reduce", nbytes, group_size=n, two_level=isinstance(axis_name, tuple))


def _sum_bucket(parts: list[jax.Array], axis_name: AxisName, n: int,
                kwargs: dict[str, str]) -> list[jax.Array]:
    """Sum a bucket's leaves over ranks with one collective."""
    nbytes = sum(p.size * p.dtype.itemsize for p in parts)
    algorithm = _resolve(kwargs, nbytes, axis_name, n)
    if algorithm == "native":
        # jaxcoll's native SUM is lax.psum; given the bucket's leaves together it binds once.
        return list(lax.psum(tuple(parts), axis_name))
    flat = jnp.concatenate([jnp.ravel(p) for p in parts])
    total = primitives.all_reduce(flat, axis_name, "sum", algorithm=algorithm)
    out, offset = [], 0
    for p in parts:
        out.append(total[offset:offset + p.size].reshape(p.shape))
        offset += p.size
    return out


@dataclass(frozen=True)
class FlatLayout:
    """How ZeRO-1 lays the params out as one flat vector cut into rank-major shards.

    The flat vector (every leaf raveled, in tree order, zero-padded) is cut into chunks of
    ``chunk`` elements (a multiple of n; the last one may be shorter), one collective each.
    Rank r's shard is the concatenation of the r-th n-th of every chunk.
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtype: Any
    n: int
    chunks: tuple[int, ...]

    @classmethod
    def of(cls, api: str, params: PyTree, n: int, bucket_bytes: float | None) -> FlatLayout:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        dtypes = {np.dtype(leaf.dtype) for leaf in leaves}
        if len(dtypes) != 1 or not jnp.issubdtype(next(iter(dtypes)), jnp.floating):
            raise TypeError(f"{api}: shard_optimizer=True needs every param leaf to have one "
                            f"floating dtype, got {sorted(str(d) for d in dtypes)}. Cast the "
                            f"params to one dtype, or use shard_optimizer=False.")
        dtype = dtypes.pop()
        total = sum(int(np.prod(leaf.shape)) for leaf in leaves)
        padded = -(-total // n) * n
        if bucket_bytes is None:
            per = padded
        else:
            per = max(n, int(bucket_bytes // dtype.itemsize) // n * n)
        chunks = tuple(min(per, padded - s) for s in range(0, padded, per))
        return cls(treedef, tuple(tuple(leaf.shape) for leaf in leaves), dtype, n, chunks)

    @property
    def size(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)

    def flatten(self, tree: PyTree) -> jax.Array:
        leaves = jax.tree_util.tree_leaves(tree)
        flat = jnp.concatenate([jnp.ravel(leaf) for leaf in leaves])
        return jnp.pad(flat, (0, sum(self.chunks) - flat.size))

    def unflatten(self, flat: jax.Array) -> PyTree:
        out, offset = [], 0
        for shape in self.shapes:
            k = int(np.prod(shape))
            out.append(flat[offset:offset + k].reshape(shape))
            offset += k
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def split(self, flat: jax.Array) -> list[jax.Array]:
        bounds = np.cumsum(self.chunks)[:-1]
        return jnp.split(flat, bounds)

    def shard(self, flat: jax.Array, rank: jax.Array) -> jax.Array:
        """Rank ``rank``'s shard of a full flat vector (no communication)."""
        parts = [lax.dynamic_index_in_dim(c.reshape(self.n, -1), rank, 0, keepdims=False)
                 for c in self.split(flat)]
        return jnp.concatenate(parts)

    def shard_split(self, shard: jax.Array) -> list[jax.Array]:
        bounds = np.cumsum([c // self.n for c in self.chunks])[:-1]
        return jnp.split(shard, bounds)


def reduce_scatter_mean(
    flat: jax.Array,
    layout: FlatLayout,
    axis_name: AxisName,
    *,
    grad_dtype: Any = None,
    algorithm: dict[str, dict[str, str]] | None = None,
) -> jax.Array:
    """ZeRO-1: this rank's shard of the mean gradient, one ``reduce_scatter`` per chunk."""
    kwargs = (algorithm or {}).get("reduce_scatter", {})
    wire = grad_dtype or flat.dtype
    flat = flat / jnp.asarray(layout.n, flat.dtype)
    # Gradients cross devices here: each rank receives only its shard of the sum.
    parts = [primitives.reduce_scatter(c.astype(wire), axis_name, "sum", tiled=True, **kwargs)
             for c in layout.split(flat)]
    return jnp.concatenate(parts).astype(flat.dtype)


def all_gather_params(
    shard: jax.Array,
    layout: FlatLayout,
    axis_name: AxisName,
    *,
    algorithm: dict[str, dict[str, str]] | None = None,
) -> PyTree:
    """ZeRO-1: rebuild the full params from every rank's updated shard, one gather per chunk."""
    kwargs = (algorithm or {}).get("all_gather", {})
    # Updated params cross devices here.
    parts = [primitives.all_gather(s, axis_name, tiled=True, **kwargs)
             for s in layout.shard_split(shard)]
    return layout.unflatten(jnp.concatenate(parts))
