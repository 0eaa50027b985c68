"""ZeRO1: ZeRO stage 1 (torch's ZeroRedundancyOptimizer). Each device keeps and updates 1/n
of the optimizer state, per leaf.

The params keep their pytree structure: every leaf with a dimension divisible by n is split
along it (the first such dimension, so each device's slice is contiguous), the others stay
replicated. The optimizer runs in ``jax.jit``'s global view on those sharded leaves, so it
sees the real tree (masks, ``multi_transform`` labels) and every reduction over params (a
global norm, lamb's trust ratio) is computed by XLA's SPMD partitioner over the whole
params: the result of any optax transformation is the unsharded one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from ... import primitives
from ..._core.typing import PyTree
from ..buckets import mean_gradients
from ..hooks.base import is_elementwise
from ..hooks.base import wire_dtype as hook_wire_dtype
from .base import Strategy, specs_like


def shard_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The dimension ZeRO-1 splits a leaf of ``shape`` along: the first one divisible by n
    (a contiguous slice per device), or None (the leaf stays replicated)."""
    for d, size in enumerate(shape):
        if size > 0 and size % n == 0:
            return d
    return None


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(getattr(leaf, "shape", np.shape(leaf)))


@dataclass(frozen=True, kw_only=True)
class ZeRO1(Strategy):
    """Reduce-scatter the gradients, update 1/n of the optimizer state, all-gather the params.

    torch's ``ZeroRedundancyOptimizer`` (under DDP). Equivalent to
    :class:`~jaxcoll.dp.sync.DDP` (every optax transformation gives the unsharded result, up
    to float rounding, ``clip_by_global_norm``, masks, ``multi_transform`` and lamb
    included), with each device holding only its slice of the optimizer state of every split
    leaf. Per step:

    1. per rank, inside ``shard_map``: each split leaf's local gradient (divided by n, in
       the wire dtype of ``hook``: :class:`~jaxcoll.dp.hooks.Compress`) is
       reduce-scattered along its split dimension (:func:`~jaxcoll.primitives.reduce_scatter`,
       ``tiled=True``): each device receives its slice of the mean; the replicated leaves
       are all-reduced by buckets (:func:`~jaxcoll.dp.mean_gradients`);
    2. in the global view: the params are resharded to the same slices (a local slice: no
       communication), ``optimizer.update`` and ``optax.apply_updates`` run on the sharded
       tree, the optimizer state pinned to its sharding (each leaf that mirrors a param is
       split like it; counts and other leaves are replicated); XLA adds one all-reduce of a
       scalar wherever the optimizer reduces over params;
    3. the updated slices are all-gathered (:func:`~jaxcoll.primitives.all_gather`,
       ``tiled=True``) back to replicated params.

    Args:
        bucket_mb: bucket size in MiB for the all-reduce of the leaves that stay replicated
            (each split leaf is one reduce-scatter); None: one collective per leaf.
        algorithm: the collective algorithm (as :class:`~jaxcoll.dp.sync.DDP`'s).
        hook: None (the exact mean) or :class:`~jaxcoll.dp.hooks.Compress` (the
            reduce-scatters travel in its dtype too). A reduce-scatter gives each device a
            slice, which a hook that needs whole gradients (PowerSGD) cannot produce;
            torch's FSDP has the same limit.

    Example (8 devices)::

        >>> trainer = dp.Trainer(loss_fn, optax.adamw(1e-3), sync=dp.sync.ZeRO1())
        >>> state = trainer.init(params, rng)   # mu, nu: 1/8 of each split leaf per device
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

    def shard_dims(self, params: PyTree) -> list[int | None]:
        """:func:`shard_dim` of every leaf of ``params``, in leaf order."""
        return [shard_dim(_shape(leaf), self.n) for leaf in jax.tree_util.tree_leaves(params)]

    def _spec(self, d: int | None) -> P:
        return P() if d is None else P(*([None] * d), self.axis_name)

    def param_specs(self, params: PyTree) -> PyTree:
        treedef = jax.tree_util.tree_structure(params)
        return jax.tree_util.tree_unflatten(
            treedef, [self._spec(d) for d in self.shard_dims(params)]
        )

    def opt_specs(self, opt_state: PyTree, params: PyTree) -> PyTree:
        """Each optimizer-state leaf that mirrors a param is split like it.

        A leaf mirrors a param when the param's path in the params tree ends its own path
        (``mu['l0']['w']`` ends with ``['l0']['w']``; the longest such path wins) and the
        shapes match; any other leaf (step counts, factored statistics) is replicated. The
        placement only decides memory: the update is exact with any placement.
        """
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        specs = jax.tree_util.tree_leaves(
            self.param_specs(params), is_leaf=lambda s: isinstance(s, P)
        )
        table = sorted(
            (
                (tuple(path), _shape(leaf), spec)
                for (path, leaf), spec in zip(flat, specs, strict=True)
            ),
            key=lambda row: -len(row[0]),
        )

        def spec_of(path, leaf):
            path, shape = tuple(path), _shape(leaf)
            for p_path, p_shape, spec in table:
                k = len(p_path)
                if k <= len(path) and path[len(path) - k :] == p_path and shape == p_shape:
                    return spec
            return P()

        if not flat:
            return specs_like(opt_state, P())
        return jax.tree_util.tree_map_with_path(spec_of, opt_state)

    def reduce(
        self, grads: PyTree, comm_state: PyTree, step: jax.Array, like: PyTree = None
    ) -> tuple[PyTree, PyTree]:
        return self.reduce_kept(grads, self.shard_dims(grads), scatter=True), comm_state

    def reduce_kept(self, grads: PyTree, dims: list[int | None], *, scatter: bool) -> PyTree:
        """The replicated leaves (``dims[i] is None``) all-reduced by buckets; with
        ``scatter`` the split leaves reduce-scattered, else passed through."""
        wire_dtype = hook_wire_dtype(self.bucket_hook)
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        out: list[Any] = list(leaves)
        kept = [i for i, d in enumerate(dims) if d is None]
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
        for i, d in enumerate(dims):
            if d is None or not scatter:
                continue
            g = leaves[i]
            wire = (g / np.asarray(self.n, g.dtype)).astype(wire_dtype or g.dtype)
            # Gradients cross devices here: each rank receives only its slice of the mean.
            out[i] = primitives.reduce_scatter(
                wire,
                self.axis_name,
                "sum",
                scatter_dimension=d,
                tiled=True,
                algorithm=self.algorithm,
            ).astype(g.dtype)
        return jax.tree_util.tree_unflatten(treedef, out)

    def update(self, grads: PyTree, opt_state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        shardings = self.named(self.param_specs(params))
        constrain = jax.lax.with_sharding_constraint
        shards = constrain(params, shardings)  # each device's slice: no communication
        updates, opt_state = self.optimizer.update(grads, opt_state, shards)
        shards = constrain(optax.apply_updates(shards, updates), shardings)
        opt_state = constrain(opt_state, self.named(self.opt_specs(opt_state, params)))
        return self.gather(shards), opt_state

    def gather(self, shards: PyTree) -> PyTree:
        """The replicated params from every device's updated slices (one gather per leaf)."""
        dims = self.shard_dims(shards)

        def body(tree):
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            # Updated params cross devices here.
            out = [
                x
                if d is None
                else primitives.all_gather(
                    x, self.axis_name, axis=d, tiled=True, algorithm=self.algorithm
                )
                for x, d in zip(leaves, dims, strict=True)
            ]
            return jax.tree_util.tree_unflatten(treedef, out)

        return jax.shard_map(
            body, mesh=self.mesh, in_specs=(self.param_specs(shards),), out_specs=P()
        )(shards)
