"""Gradient buckets: the exact global mean of the local gradients, one collective per bucket.

:func:`plan_buckets` groups the gradient leaves as DDP does, :func:`sync_buckets` sends each
bucket through a communication hook (:mod:`jaxcoll.dp.hooks`), :func:`mean_gradients` is the
plain mean with the default hook: what :class:`~jaxcoll.dp.sync.DDP` runs, and what the
sharded strategies run for the leaves they keep whole.

Everything here runs inside ``jax.shard_map`` on *local* gradients: gradients of the local
per-example-mean loss taken with respect to params made varying over the data axis (see the
gradient trap, docs/porting.md). Each rank holds the same number of examples, so the global
mean is the sum over ranks of ``g_local / n``: every leaf is divided by n exactly once,
before the reduction (as DDP does), and reduced exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from ... import primitives
from ..._core.typing import AxisName, PyTree, Shaped
from ..._core.vma import varying_axes
from ..hooks.base import AllReduceHook, Bucket, CommHook, Compress


def plan_buckets(
    leaves: Sequence[Shaped], bucket_bytes: float | None, kinds: Sequence[Any] | None = None
) -> list[list[int]]:
    """Group leaf indices into buckets of about ``bucket_bytes`` each, one dtype per bucket.

    Like DDP, leaves are taken in reverse order (the last layer's gradient is ready first in
    a backward pass) and a bucket is closed once it holds ``bucket_bytes`` or more, or when
    the dtype changes. ``bucket_bytes=None`` puts every leaf in its own bucket (bucketing off).
    Inside ``jax.shard_map`` a bucket also holds leaves of one varying type only (a tensor
    parallel slice and a replicated leaf never share a buffer, which would type the
    replicated one varying): ``kinds[i]`` when given, else each array's varying axes.
    """
    if kinds is None:
        kinds = [varying_axes(x) if isinstance(x, jax.Array) else None for x in leaves]
    buckets: list[list[int]] = []
    size = 0.0
    key: Any = None
    for i in reversed(range(len(leaves))):
        leaf = leaves[i]
        nbytes = float(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        full = bucket_bytes is None or size >= bucket_bytes
        if not buckets or full or (leaf.dtype, kinds[i]) != key:
            buckets.append([])
            size, key = 0.0, (leaf.dtype, kinds[i])
        buckets[-1].append(i)
        size += nbytes
    return buckets


def mean_gradients(
    grads: PyTree,
    axis_name: AxisName,
    *,
    bucket_bytes: float | None,
    grad_dtype: DTypeLike | None = None,
    algorithm: str = "auto",
) -> PyTree:
    """The mean over ranks of each rank's local gradient, one all-reduce per bucket.

    Equivalent to ``jax.tree.map(lambda g: all_reduce(g, axis_name, "avg"), grads)``. Each
    leaf is divided by n, cast to ``grad_dtype`` when given (e.g. bfloat16, DDP's
    ``bf16_compress_hook``), summed over ranks, and cast back to its own dtype. Values are
    never mixed between leaves or buckets: an inf or NaN stays in its own leaf.
    :func:`sync_buckets` with the hook :class:`~jaxcoll.dp.hooks.Compress` (or the default).

    Args:
        grads: the local gradients (a pytree), inside ``jax.shard_map``.
        axis_name: the data axis (or tuple of axes).
        bucket_bytes: bucket size in bytes; None: one bucket per leaf.
        grad_dtype: the dtype gradients travel in; None: each leaf's own.
        algorithm: the all-reduce algorithm (:data:`jaxcoll.algorithms.ALGORITHMS`).

    Returns:
        The mean gradients, like ``grads``, typed invariant (equal on every rank).
    """
    hook = AllReduceHook() if grad_dtype is None else Compress(grad_dtype)
    leaves = jax.tree_util.tree_leaves(grads)
    states = [() for _ in plan_buckets(leaves, bucket_bytes)]
    means, _ = sync_buckets(
        grads,
        axis_name,
        bucket_bytes=bucket_bytes,
        hook=hook,
        states=states,
        step=jnp.zeros((), jnp.int32),
        algorithm=algorithm,
    )
    return means


def sync_buckets(
    grads: PyTree,
    axis_name: AxisName,
    *,
    bucket_bytes: float | None,
    hook: CommHook,
    states: list[PyTree],
    step: jax.Array,
    algorithm: str = "auto",
) -> tuple[PyTree, list[PyTree]]:
    """The local gradients averaged over ranks bucket by bucket by ``hook``, inside shard_map.

    For each bucket of :func:`plan_buckets` (DDP's order: the last leaves first), in order:
    ``hook(states[k], Bucket(grads of the bucket, k, ...)) -> (means, states[k])``. Each
    bucket's collectives depend only on that bucket's own gradients, never on another
    bucket's result, so XLA's scheduler is free to start a bucket's communication as soon as
    the backward pass has produced its leaves and overlap it with the rest of the backward
    (a combiner may also merge independent buckets, as XLA:CPU's does).

    Lowering with the default hook: with the native algorithm (``"native"``, or ``"auto"``
    where jaxcoll's table picks native) one ``lax.psum`` over the bucket's leaves (one
    StableHLO ``all_reduce`` per leaf, which XLA's all-reduce combiner merges; no copy into a
    staging buffer: packing the MLP benchmark's gradients into one flat buffer made the step
    3-4x slower on CPU). With ``"ring"``, ``"tree"`` or ``"hierarchical"`` the leaves are
    packed into one flat buffer for one :func:`jaxcoll.primitives.all_reduce` call.

    Returns:
        ``(means, states)``: the mean gradients like ``grads`` (typed invariant) and each
        bucket's new hook state.
    """
    n = primitives.world_size(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    out: list[Any] = [None] * len(leaves)
    new_states = []
    for k, bucket in enumerate(plan_buckets(leaves, bucket_bytes)):
        view = Bucket(tuple(leaves[i] for i in bucket), k, axis_name, n, algorithm, step)
        means, state = hook(states[k], view)
        means = list(means)
        if len(means) != len(bucket):
            raise ValueError(
                f"hook {hook!r} returned {len(means)} gradients for a bucket "
                f"of {len(bucket)}; it must return one mean per gradient."
            )
        for i, g in zip(bucket, means, strict=True):
            if g.shape != leaves[i].shape or g.dtype != leaves[i].dtype:
                raise ValueError(
                    f"hook {hook!r} returned a gradient of {g.dtype}{list(g.shape)} for "
                    f"one of {leaves[i].dtype}{list(leaves[i].shape)}; it must return each "
                    f"gradient's mean in that gradient's shape and dtype."
                )
            out[i] = g
        new_states.append(state)
    return jax.tree_util.tree_unflatten(treedef, out), new_states
