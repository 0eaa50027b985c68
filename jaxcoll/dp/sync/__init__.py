"""Gradient-sync strategies: how per-rank local gradients become one optimizer step.

Each is an optax-like pair behind one small interface (:class:`GradSync`): ``init(params)``
builds the placed optimizer state, ``reduce(grads)`` runs per rank inside the step's
``shard_map``, ``update(grads, opt_state, params)`` runs in the global view of the same jit.
"""

from .all_reduce import AllReduce as AllReduce
from .base import GradSync as GradSync
from .fsdp import Fsdp as Fsdp
from .zero1 import Zero1 as Zero1

__all__ = [
    "AllReduce",
    "Fsdp",
    "GradSync",
    "Zero1",
]
