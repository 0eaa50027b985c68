"""Gradient-sync strategies: how per-rank local gradients become one optimizer step.

``dp.Trainer(loss_fn, optimizer, sync=...)`` takes one of these values; each checks its own
fields when it is constructed:

* :class:`DDP` (the default): torch's ``DistributedDataParallel``, a bucketed all-reduce with
  an optional communication hook (``register_comm_hook``: ``hook=dp.hooks.PowerSGD(...)``);
* :class:`ZeRO1`: torch's ``ZeroRedundancyOptimizer``, 1/n of the optimizer state per device;
* :class:`FSDP`: torch's ``FullyShardedDataParallel`` (ZeRO-3), 1/n of the params, gradients
  and optimizer state per device;
* :class:`DiLoCo`, :class:`LocalSGD` and :class:`StreamingDiLoCo`: semi-synchronous
  training, each replica stepping on its own params (an inner strategy averaging within it)
  and the replicas meeting every few steps.

Each is one class behind one small interface (:class:`Strategy`): ``init(params)`` builds
the placed optimizer state, ``loss_of_held(loss, like)`` and ``reduce(grads, comm_state, step)``
run per rank inside the step's ``shard_map``, ``update(grads, opt_state, params)`` runs in
the global view of the same jit. A new strategy is a new subclass, nothing else.
"""

from .base import Strategy as Strategy
from .ddp import DDP as DDP
from .fsdp import FSDP as FSDP
from .precision import MixedPrecisionPolicy as MixedPrecisionPolicy
from .semisync import DiLoCo as DiLoCo
from .semisync import LocalSGD as LocalSGD
from .semisync import SemiSyncState as SemiSyncState
from .streaming import StreamingDiLoCo as StreamingDiLoCo
from .zero1 import ZeRO1 as ZeRO1

__all__ = [
    "DDP",
    "FSDP",
    "DiLoCo",
    "LocalSGD",
    "MixedPrecisionPolicy",
    "SemiSyncState",
    "Strategy",
    "StreamingDiLoCo",
    "ZeRO1",
]
