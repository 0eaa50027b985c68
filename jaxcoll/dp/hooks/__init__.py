"""Communication hooks: how each bucket of gradients is averaged (DDP's ``register_comm_hook``).

``sync=dp.sync.DDP(hook=hook)``. :class:`CommHook` is the interface (see
:mod:`jaxcoll.dp.hooks.base`); :class:`AllReduceHook`, :class:`Compress` and
:class:`PowerSGD` are torch's ``allreduce_hook``, ``bf16_compress_hook`` /
``fp16_compress_hook`` and ``powerSGD_hook``.
"""

from .base import AllReduceHook as AllReduceHook
from .base import Bucket as Bucket
from .base import CommHook as CommHook
from .base import Compress as Compress
from .base import PhasedHook as PhasedHook
from .base import StatefulHook as StatefulHook
from .powersgd import PowerSGD as PowerSGD

__all__ = [
    "AllReduceHook",
    "Bucket",
    "CommHook",
    "Compress",
    "PhasedHook",
    "PowerSGD",
    "StatefulHook",
]
