"""ZeRO1: ZeRO stage 1 (torch's ZeroRedundancyOptimizer). Each device keeps and updates 1/n
of the optimizer state, per leaf.

The params keep their pytree structure: every leaf with a dimension divisible by n is split
along it (the first such dimension, so each device's slice is contiguous), the others stay
replicated; n is the number of data ranks, or the size of the layout's shard axis (hybrid
sharding, ``dp.Layout(replicate=..., shard=...)``: split over the shard axis, replicated over
the others). The optimizer runs in ``jax.jit``'s
global view on those sharded leaves, so it sees the real tree (masks, ``multi_transform``
labels) and every reduction over params (a global norm, lamb's trust ratio) is computed by
XLA's SPMD partitioner over the whole params: the result of any optax transformation is the
unsharded one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import numpy as np
import optax
from jax.typing import DTypeLike

from ..._core.typing import AxisName, PyTree
from ..._core.vma import axis_names
from ..checks import removed_keywords
from ..hooks.base import is_elementwise
from ..hooks.base import wire_dtype as hook_wire_dtype
from ..layout import BoundLayout
from ..specs import merge, used_dims
from .base import Prepared, Strategy, leaf_shape
from .buckets import mean_gradients
from .packing import divides_after, gather_leaves, scatter_leaves, sum_leaves

#: What ``shard_axis=`` became: the layout names the shard axis.
SHARD_AXIS_GONE = (
    "the layout names the shard axis: layout=dp.Layout(shard=...) splits the state over it "
    "(dp.Layout(shard='data') on your mesh), and layout=dp.Layout(replicate=..., shard=...) "
    "splits it over the shard axis and replicates it over the others (hybrid sharding)"
)


def _hybrid_axis(layout: BoundLayout) -> AxisName | None:
    """HSDP's shard axis (or axes): the layout's, where there are other data axes (the slices
    replicated over them); None: the state is split over every data axis."""
    shard = layout.shard_axis
    if shard is None or set(axis_names(shard)) == set(layout.data_axes):
        return None
    return shard


def shard_dim(shape: tuple[int, ...], n: int, taken: frozenset[int] = frozenset()) -> int | None:
    """The dimension ZeRO-1 splits a leaf of ``shape`` along: the first one divisible by n
    that the model spec leaves whole (not in ``taken``: a contiguous slice per device), or
    None (the leaf stays replicated over the data axes)."""
    for d, size in enumerate(shape):
        if d not in taken and size > 0 and size % n == 0:
            return d
    return None


@removed_keywords(shard_axis=SHARD_AXIS_GONE)
@dataclass(frozen=True, kw_only=True)
class ZeRO1(Strategy):
    """Reduce-scatter the gradients, update 1/n of the optimizer state, all-gather the params.

    torch's ``ZeroRedundancyOptimizer`` (under DDP). Equivalent to
    :class:`~jaxcoll.dp.sync.DDP` (every optax transformation gives the unsharded result, up
    to float rounding, ``clip_by_global_norm``, masks, ``multi_transform`` and lamb
    included), with each device holding only its slice of the optimizer state of every split
    leaf. Per step:

    1. per rank, inside ``shard_map``: each split leaf's local gradient (in the wire dtype
       of ``hook``: :class:`~jaxcoll.dp.hooks.Compress`, divided by n first; else divided
       after the sum) is reduce-scattered along its split dimension, the split leaves of a
       bucket in one reduce-scatter (:func:`~jaxcoll.dp.sync.packing.scatter_leaves`):
       each device receives its slice of the mean; the replicated leaves are all-reduced
       by buckets
       (:func:`~jaxcoll.dp.mean_gradients`);
    2. in the global view: the params are resharded to the same slices (a local slice: no
       communication), ``optimizer.update`` and ``optax.apply_updates`` run on the sharded
       tree, the optimizer state pinned to its sharding (each leaf that mirrors a param is
       split like it; counts and other leaves are replicated); XLA adds one all-reduce of a
       scalar wherever the optimizer reduces over params;
    3. the updated slices are all-gathered back to replicated params, the split leaves of a
       bucket in one all-gather (:func:`~jaxcoll.dp.sync.packing.gather_leaves`).

    Hybrid sharding (torch FSDP's ``HYBRID_SHARD``, HSDP) where the Trainer's layout has a
    shard axis beside other data axes (``dp.Layout(replicate=2, shard=4)``): the params'
    slices and the optimizer state are split over the shard axis alone (its size must divide
    the split dimension) and replicated over the other data axes; the gradients are
    reduce-scattered over the shard axis (the local gradient divided by the *total* number of
    data ranks), then each slice is summed over the other data axes (one all-reduce per
    bucket), so every slice is the global mean; the update is all-gathered over the shard
    axis alone. The collectives over the shard axis stay within its group (one host's
    devices, say), and only slices cross the replica axes. (Not with
    ``algorithm="hierarchical"``.)

    Args:
        bucket_mb: bucket size in MiB (DDP's ``bucket_cap_mb``) for every collective of the
            step: the all-reduce of the leaves that stay replicated, the reduce-scatter of
            the split leaves' gradients and the all-gather of their updated slices (split
            leaves of a bucket travel as one buffer, planned on the whole leaves' bytes);
            None: one collective per leaf.
        algorithm: the collective algorithm (as :class:`~jaxcoll.dp.sync.DDP`'s).
        hook: None (the exact mean) or :class:`~jaxcoll.dp.hooks.Compress` (the
            reduce-scatters travel in its dtype too). A reduce-scatter gives each device a
            slice, which a hook that needs whole gradients (PowerSGD) cannot produce;
            torch's FSDP has the same limit.

    Example (8 devices)::

        >>> trainer = dp.Trainer(loss_fn, optax.adamw(1e-3), sync=dp.sync.ZeRO1())
        >>> state = trainer.init(params, rng)   # mu, nu: 1/8 of each split leaf per device
        >>> hybrid = dp.Trainer(loss_fn, optax.adamw(1e-3),
        ...                     layout=dp.Layout(replicate=2, shard=4),
        ...                     sync=dp.sync.ZeRO1())  # 1/4 per device
    """

    grad_route: ClassVar[str] = (
        "reduce-scattered (all-reduced where no dimension splits) "
        "over the devices (ZeRO-1, sync=dp.sync.ZeRO1())"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_elementwise(self.hook):
            raise ValueError(
                f"{self.api}: hook={self.hook!r} cannot be used with a sharded strategy: "
                f"{type(self).__name__} reduce-scatters each gradient, so each device "
                f"receives a slice, and only the default hook and dp.hooks.Compress work on "
                f"slices. Use this hook with dp.sync.DDP(hook=...), or pass "
                f"hook=dp.hooks.Compress(dtype) or None here."
            )

    def check_prepared(self, prepared: Prepared) -> None:
        hybrid = _hybrid_axis(prepared.layout)
        if hybrid is not None and self.algorithm == "hierarchical":
            raise ValueError(
                f"{self.api}: algorithm='hierarchical' needs collectives over a tuple of axes, "
                f"but {prepared.layout.layout!r} splits the state over its shard axis "
                f"{hybrid!r} alone (and the others separately: hybrid sharding is two-level "
                f"already). Pass algorithm='auto', 'native', 'ring' or 'tree'."
            )

    # ----------------------------------------------------------------------------- sharding
    @property
    def shard_axis_name(self) -> AxisName:
        """The mesh axis (or tuple of axes) the params are split over (prepared): the
        layout's shard axis where other data axes replicate the slices (HSDP), else every
        data axis (:attr:`axis_name`)."""
        hybrid = _hybrid_axis(self.layout)
        return self.axis_name if hybrid is None else hybrid

    @property
    def n_shard(self) -> int:
        """The number of slices a split leaf is cut into: the size of
        :attr:`shard_axis_name` (bound)."""
        return int(np.prod([self.mesh.shape[a] for a in axis_names(self.shard_axis_name)]))

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The data axes the slices are replicated over (prepared): every data axis but the
        shard axis under hybrid sharding; empty otherwise."""
        hybrid = _hybrid_axis(self.layout)
        if hybrid is None:
            return ()
        return tuple(a for a in axis_names(self.axis_name) if a not in axis_names(hybrid))

    def shard_dims(self, params: PyTree) -> list[int | None]:
        """:func:`shard_dim` of every leaf of ``params`` over :attr:`n_shard` slices, in leaf
        order, never along a dimension the leaf's model spec splits (the same dimension for
        the global leaf and for the local slice the step sees)."""
        n = self.n_shard
        models = self.model_leaf_specs(params)
        held = self.held_axes(params)
        return [
            None if h else shard_dim(leaf_shape(leaf), n, used_dims(m))
            for leaf, m, h in zip(jax.tree_util.tree_leaves(params), models, held, strict=True)
        ]

    def param_specs(self, params: PyTree) -> PyTree:
        """Each leaf's model spec with its :meth:`shard_dims` dimension split over
        :attr:`shard_axis_name` as well."""
        treedef = jax.tree_util.tree_structure(params)
        models = self.model_leaf_specs(params)
        return jax.tree_util.tree_unflatten(
            treedef,
            [
                merge(m, d, self.shard_axis_name)
                for m, d in zip(models, self.shard_dims(params), strict=True)
            ],
        )

    def reduce(
        self, grads: PyTree, comm_state: PyTree, step: jax.Array, like: PyTree = None
    ) -> tuple[PyTree, PyTree]:
        return self.reduce_kept(grads, self.shard_dims(grads), scatter=True), comm_state

    def reduce_kept(self, grads: PyTree, dims: list[int | None], *, scatter: bool) -> PyTree:
        """The replicated leaves (``dims[i] is None``) all-reduced by buckets; with
        ``scatter`` the split leaves reduce-scattered, else passed through."""
        wire_dtype = hook_wire_dtype(self.bucket_hook)
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        # leaves split over a data axis (experts) first; the others' collectives below
        out, others = self.reduce_held_leaves(leaves, self.held_axes(grads))
        kept = [i for i in others if dims[i] is None]
        if kept:
            # Gradients of the replicated leaves cross devices here: one all-reduce per bucket.
            means = mean_gradients(
                [leaves[i] for i in kept],
                self.axis_name,
                bucket_bytes=self.bucket_bytes,
                grad_dtype=wire_dtype,
                algorithm=self.algorithm,
            )
            for i, g in zip(kept, means, strict=True):
                out[i] = g
        split = {i: d for i, d in enumerate(dims) if d is not None}
        if scatter and split:
            slices = self.scatter_split(
                [leaves[i] for i in split], list(split.values()), wire_dtype
            )
            for i, g in zip(split, slices, strict=True):
                out[i] = g
        return jax.tree_util.tree_unflatten(treedef, out)

    def scatter_split(
        self, grads: list[jax.Array], dims: list[int], wire_dtype: DTypeLike | None
    ) -> list[jax.Array]:
        """Per rank: the local gradients of split leaves -> this rank's slices of the global
        mean, one reduce-scatter per bucket over :attr:`shard_axis_name`, then (hybrid
        sharding) one all-reduce per bucket over :attr:`replica_axes`."""
        # Divided by every data rank's count: the sum over the shard axis, then over the
        # replica axes, is the global mean (divided after the sums or before the cast).
        after = divides_after(wire_dtype, [g.dtype for g in grads])
        if not after:
            grads = [g / np.asarray(self.n, g.dtype) for g in grads]
        # Gradients cross devices here: each rank receives only its slice of the sum.
        slices = scatter_leaves(
            grads,
            dims,
            self.shard_axis_name,
            algorithm=self.algorithm,
            bucket_bytes=self.bucket_bytes,
            wire_dtype=wire_dtype,
        )
        slices = self.sum_over_replicas(slices, wire_dtype)
        return [g / np.asarray(self.n, g.dtype) for g in slices] if after else slices

    def sum_over_replicas(
        self, slices: list[jax.Array], wire_dtype: DTypeLike | None
    ) -> list[jax.Array]:
        """Per rank (hybrid sharding): each slice summed over :attr:`replica_axes`, one
        all-reduce per bucket, in ``wire_dtype`` when given; the slices unchanged without
        hybrid sharding."""
        replicas = self.replica_axes
        if not replicas:
            return list(slices)
        return sum_leaves(
            slices,
            replicas[0] if len(replicas) == 1 else replicas,
            algorithm=self.algorithm,
            bucket_bytes=self.bucket_bytes,
            wire_dtype=wire_dtype,
        )

    def update(self, grads: PyTree, opt_state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        shardings = self.named(self.param_specs(params))
        constrain = jax.lax.with_sharding_constraint
        shards = constrain(params, shardings)  # each device's slice: no communication
        updates, opt_state = self.optimizer.update(grads, opt_state, shards)
        shards = constrain(optax.apply_updates(shards, updates), shardings)
        opt_state = constrain(opt_state, self.named(self.opt_specs(opt_state, params)))
        return self.gather(shards), opt_state

    def gather(self, shards: PyTree) -> PyTree:
        """The replicated params from every device's updated slices: one all-gather per
        bucket of split leaves over :attr:`shard_axis_name`
        (:func:`~jaxcoll.dp.sync.packing.gather_leaves`)."""
        split = {i: d for i, d in enumerate(self.shard_dims(shards)) if d is not None}

        def body(tree):
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            out = list(leaves)
            # Updated params cross devices here: one all-gather per bucket.
            whole = gather_leaves(
                [leaves[i] for i in split],
                list(split.values()),
                self.shard_axis_name,
                algorithm=self.algorithm,
                bucket_bytes=self.bucket_bytes,
            )
            for i, x in zip(split, whole, strict=True):
                out[i] = x
            return jax.tree_util.tree_unflatten(treedef, out)

        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(self.param_specs(shards),),
            out_specs=self.model_specs(shards),
        )(shards)
