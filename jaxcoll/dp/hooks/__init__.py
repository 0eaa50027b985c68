"""Communication hooks: how each bucket of gradients is averaged (DDP's ``register_comm_hook``).

``Trainer(..., comm_hook=hook)``. See :mod:`jaxcoll.dp.hooks.base` for the interface.
"""

from .base import AllReduceHook as AllReduceHook
from .base import Bucket as Bucket
from .base import Compress as Compress
from .powersgd import PowerSGD as PowerSGD

__all__ = [
    "AllReduceHook",
    "Bucket",
    "Compress",
    "PowerSGD",
]
