"""AllReduce: DDP's strategy. Bucketed all-reduce of the gradients, the same update everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import optax

from ..._core.typing import PyTree
from ..buckets import plan_buckets, sync_buckets
from .base import GradSync


@dataclass(frozen=True)
class AllReduce(GradSync):
    """Average the gradients with one all-reduce per bucket; every rank applies the update.

    Equivalent to::

        grads = jax.tree.map(lambda g: all_reduce(g, axis_name, "avg"), local_grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

    :meth:`reduce` is :func:`~jaxcoll.dp.buckets.sync_buckets` (buckets of
    ``bucket_bytes``, each through ``comm_hook``, ``algorithm`` for its collectives); the
    params, the gradients and the optimizer state are replicated, so :meth:`update` is plain
    optax, which each device computes on its own copy (no communication).

    Example (8 devices)::

        >>> sync = AllReduce(optax.adam(1e-3), mesh, "data", bucket_bytes=25 * 2**20)
        >>> opt_state = sync.init(params)              # replicated
    """

    grad_route: ClassVar[str] = "averaged over the devices by all-reduce (DDP)"

    def reduce(self, grads: PyTree, comm_state: PyTree, step: jax.Array,
               like: PyTree = None) -> tuple[PyTree, PyTree]:
        count = len(plan_buckets(jax.tree_util.tree_leaves(grads), self.bucket_bytes))
        states = list(comm_state) if comm_state else [() for _ in range(count)]
        # Gradients cross devices here: each bucket through the hook (one all-reduce each
        # with the default hook).
        means, states = sync_buckets(grads, self.axis_name, bucket_bytes=self.bucket_bytes,
                                     hook=self.hook, states=states, step=step,
                                     algorithm=self.algorithm)
        return means, (states if comm_state else comm_state)

    def update(self, grads: PyTree, opt_state: PyTree,
               params: PyTree) -> tuple[PyTree, PyTree]:
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
