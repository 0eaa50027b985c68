"""AllReduce: DDP's strategy. Bucketed all-reduce of the gradients, the same update everywhere."""

from __future__ import annotations

from dataclasses import dataclass

import optax

from ..._core.typing import PyTree
from ..grad_sync import mean_gradients
from .base import GradSync


@dataclass(frozen=True)
class AllReduce(GradSync):
    """Average the gradients with one all-reduce per bucket; every rank applies the update.

    Equivalent to::

        grads = jax.tree.map(lambda g: all_reduce(g, axis_name, "avg"), local_grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

    :meth:`reduce` is :func:`~jaxcoll.dp.mean_gradients` (buckets of ``bucket_bytes``,
    ``grad_dtype`` on the wire, ``algorithm`` for each bucket's collective); the params, the
    gradients and the optimizer state are replicated, so :meth:`update` is plain optax, which
    each device computes on its own copy (no communication).

    Example (8 devices)::

        >>> sync = AllReduce(optax.adam(1e-3), mesh, "data", bucket_bytes=25 * 2**20)
        >>> opt_state = sync.init(params)              # replicated
    """

    def reduce(self, grads: PyTree) -> PyTree:
        # Gradients cross devices here: one all-reduce per bucket.
        return mean_gradients(grads, self.axis_name, bucket_bytes=self.bucket_bytes,
                              grad_dtype=self.grad_dtype, algorithm=self.algorithm)

    def update(self, grads: PyTree, opt_state: PyTree,
               params: PyTree) -> tuple[PyTree, PyTree]:
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
