"""DDP: torch's DistributedDataParallel. Bucketed all-reduce of the gradients, the same update
everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import optax

from ..._core.typing import PyTree
from .base import Strategy
from .buckets import plan_buckets, sync_buckets


@dataclass(frozen=True, kw_only=True)
class DDP(Strategy):
    """Average the gradients with one all-reduce per bucket; every rank applies the update.

    torch's ``DistributedDataParallel(model, bucket_cap_mb=bucket_mb)``, with
    ``register_comm_hook`` as ``hook``. Equivalent to::

        grads = jax.tree.map(lambda g: all_reduce(g, axis_name, "avg"), local_grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

    :meth:`reduce` is :func:`~jaxcoll.dp.sync.buckets.sync_buckets`: the gradients in buckets of
    about ``bucket_mb`` MiB, in DDP's order (the last leaves first), each bucket through
    ``hook`` (the default: one all-reduce with ``algorithm``); each bucket's collectives
    depend only on its own gradients, so XLA may overlap them with the rest of the backward.
    The params, the gradients and the optimizer state are replicated, so :meth:`update` is
    plain optax, which each device computes on its own copy (no communication).

    Args:
        bucket_mb: bucket size in MiB (DDP's ``bucket_cap_mb``); None: one collective per
            leaf (bucketing off).
        algorithm: the collective algorithm: ``"auto"``, ``"native"`` (one lax
            collective), ``"ring"``, ``"tree"`` or ``"hierarchical"`` (a tuple
            ``axis_name``).
        hook: how each bucket of gradients is averaged (DDP's ``register_comm_hook``,
            :mod:`jaxcoll.dp.hooks`): ``dp.hooks.Compress(jnp.bfloat16)`` (DDP's
            ``bf16_compress_hook``: the gradients travel in bfloat16, the update stays in
            the params' dtype), ``dp.hooks.PowerSGD(rank=4)``, or your own
            :class:`~jaxcoll.dp.hooks.CommHook`; its state is carried in
            ``state.comm_state``. None: the exact mean.

    Example (8 devices)::

        >>> trainer = dp.Trainer(loss_fn, optax.adam(1e-3),
        ...                      sync=dp.sync.DDP(hook=dp.hooks.Compress(jnp.bfloat16)))
    """

    grad_route: ClassVar[str] = "averaged over the devices by all-reduce (DDP)"

    def reduce(
        self, grads: PyTree, comm_state: PyTree, step: jax.Array, like: PyTree = None
    ) -> tuple[PyTree, PyTree]:
        held = self.held_axes(grads)
        if any(held):
            return self._reduce_with_held(grads, comm_state, step, held)
        count = len(plan_buckets(jax.tree_util.tree_leaves(grads), self.bucket_bytes))
        states = list(comm_state) if comm_state else [() for _ in range(count)]
        # Gradients cross devices here: each bucket through the hook (one all-reduce each
        # with the default hook).
        means, states = sync_buckets(
            grads,
            self.axis_name,
            bucket_bytes=self.bucket_bytes,
            hook=self.bucket_hook,
            states=states,
            step=step,
            algorithm=self.algorithm,
        )
        return means, (states if comm_state else comm_state)

    def _reduce_with_held(
        self, grads: PyTree, comm_state: PyTree, step: jax.Array, held: list[tuple[str, ...]]
    ) -> tuple[PyTree, PyTree]:
        """The leaves split over a data axis (experts) summed over the others
        (:meth:`~jaxcoll.dp.sync.Strategy.reduce_held`), the rest by buckets."""
        if comm_state:
            raise ValueError(
                f"{self.api}: hook={self.hook!r} keeps state per bucket, and these params "
                f"hold experts split over a data axis, which do not travel in buckets; use "
                f"a stateless hook (dp.hooks.Compress) or none."
            )
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        out, whole = self.reduce_held_leaves(leaves, held)
        means, _ = sync_buckets(
            [leaves[i] for i in whole],
            self.axis_name,
            bucket_bytes=self.bucket_bytes,
            hook=self.bucket_hook,
            states=[() for _ in plan_buckets([leaves[i] for i in whole], self.bucket_bytes)],
            step=step,
            algorithm=self.algorithm,
        )
        for i, g in zip(whole, means, strict=True):
            out[i] = g
        return jax.tree_util.tree_unflatten(treedef, out), comm_state

    def update(self, grads: PyTree, opt_state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
