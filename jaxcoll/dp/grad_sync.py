"""Gradient synchronisation: the exact global mean, one jaxcoll collective per bucket.

Everything here runs inside ``jax.shard_map`` on *local* gradients: gradients of the local
per-example-mean loss taken with respect to params made varying over the data axis (see the
gradient trap in the README). Each rank holds the same number of examples, so the global
mean is the sum over ranks of ``g_local / n``: every leaf is divided by n exactly once,
before the reduction (as DDP does), and reduced exactly once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import primitives
from .._core.packing import pack, unpack
from .._core.typing import AxisName, PyTree
from ..algorithms.registry import check_algorithm, resolve


def check_grad_sync(api: str, grad_sync: Any) -> str:
    """``grad_sync`` must name an algorithm of :data:`jaxcoll.algorithms.ALGORITHMS`.

    Raises:
        TypeError: ``grad_sync`` is not a string.
        ValueError: ``grad_sync`` is not one of the algorithms.
    """
    return check_algorithm(api, grad_sync, argname="grad_sync")


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
    algorithm: str = "auto",
) -> PyTree:
    """The mean over ranks of each rank's local gradient, one all-reduce per bucket.

    Equivalent to ``jax.tree.map(lambda g: all_reduce(g, axis_name, "avg"), grads)``. Each
    leaf is divided by n, cast to ``grad_dtype`` when given (e.g. bfloat16, DDP's
    ``bf16_compress_hook``), summed over ranks, and cast back to its own dtype. Values are
    never mixed between leaves or buckets: an inf or NaN stays in its own leaf.

    Lowering, per bucket of :func:`plan_buckets`: with the native algorithm (``"native"``, or
    ``"auto"`` where jaxcoll's table picks native) one ``lax.psum`` over the bucket's leaves
    (one StableHLO ``all_reduce`` per leaf, which XLA's all-reduce combiner merges into ONE
    all-reduce op per bucket in the compiled HLO; no copy into a staging buffer: packing the
    MLP benchmark's gradients into one flat buffer made the step 3-4x slower on CPU). With
    ``"ring"``, ``"tree"`` or ``"hierarchical"`` the leaves are packed into one flat buffer for
    one :func:`jaxcoll.primitives.all_reduce` call with that algorithm. The buckets are
    chained in DDP's order (see :func:`after`), so the combiner never merges two of them.

    Args:
        grads: the local gradients (a pytree), inside ``jax.shard_map``.
        axis_name: the data axis (or tuple of axes).
        bucket_bytes: bucket size in bytes; None: one bucket per leaf.
        grad_dtype: the dtype gradients travel in; None: each leaf's own.
        algorithm: the all-reduce algorithm (:data:`jaxcoll.algorithms.ALGORITHMS`).

    Returns:
        The mean gradients, like ``grads``, typed invariant (equal on every rank).
    """
    n = primitives.world_size(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    out: list[Any] = [None] * len(leaves)
    previous: list[jax.Array] = []
    for bucket in plan_buckets(leaves, bucket_bytes):
        parts = [leaves[i] for i in bucket]
        dtype = parts[0].dtype
        wire = [(p / jnp.asarray(n, dtype)).astype(grad_dtype or dtype) for p in parts]
        wire = after(wire, previous)
        # Gradients cross devices here: one collective per bucket.
        summed = _sum_bucket(wire, axis_name, n, algorithm)
        for i, total in zip(bucket, summed, strict=True):
            out[i] = total.astype(dtype)
        previous = summed
    return jax.tree_util.tree_unflatten(treedef, out)


def after(wire: list[jax.Array], previous: list[jax.Array]) -> list[jax.Array]:
    """``wire`` unchanged, bit for bit, but computed after ``previous`` (the last bucket).

    Orders the buckets as DDP launches them, so that XLA's all-reduce combiner merges the
    leaves of one bucket into one all-reduce op but never merges two buckets. Every leaf of
    the last bucket's result (one all-reduce each before the combiner) contributes
    ``z_i = |where(isfinite(p_i), p_i, 0)| * 0``, which is ``+0.0`` for every ``p_i``, inf and
    NaN included; ``w + -(sum z_i)`` is ``w + -0.0 == w`` exactly for every ``w``: no value of
    one bucket can reach another. (``lax.optimization_barrier`` would order them without
    arithmetic, but XLA:CPU removes barriers before its all-reduce combiner runs, which then
    merges the buckets; the compiled-HLO test would fail.) Fused into the division by n.
    """
    if not previous:
        return wire
    z = [jnp.abs(jnp.where(jnp.isfinite(p), p, jnp.zeros_like(p))) * 0
         for p in (jnp.ravel(q)[0] for q in previous)]
    neg_zero = -sum(z[1:], z[0])
    return [w + neg_zero.astype(w.dtype) for w in wire]


def _sum_bucket(parts: list[jax.Array], axis_name: AxisName, n: int,
                algorithm: str) -> list[jax.Array]:
    """Sum a bucket's leaves over ranks with one collective."""
    nbytes = sum(p.size * p.dtype.itemsize for p in parts)
    algorithm = resolve("all_reduce", algorithm, nbytes, group_size=n,
                        two_level=isinstance(axis_name, tuple))
    if algorithm == "native":
        # jaxcoll's native SUM is lax.psum; given the bucket's leaves together it binds once.
        return list(lax.psum(tuple(parts), axis_name))
    total = primitives.all_reduce(pack(parts), axis_name, "sum", algorithm=algorithm)
    return unpack(total, parts)
