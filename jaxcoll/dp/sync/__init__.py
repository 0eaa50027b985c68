"""Gradient-sync strategies: how per-rank local gradients become one optimizer step.

Each is an optax-like pair behind one small interface (:class:`GradSync`): ``init(params)``
builds the placed optimizer state, ``materialize(params)`` and ``reduce(grads, comm_state,
step)`` run per rank inside the step's ``shard_map``, ``update(grads, opt_state, params)``
runs in the global view of the same jit. :class:`AllReduce` is DDP, :class:`Zero1` ZeRO-1
(torch's ZeroRedundancyOptimizer), :class:`Fsdp` ZeRO-3 (FullyShardedDataParallel).
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
