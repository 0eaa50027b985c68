"""jaxcoll: torch.distributed's collective vocabulary as SPMD code over a JAX device mesh.

Importing jaxcoll queries no device and changes no setting. The data-parallel trainer needs
the ``dp`` extra (flax, optax, orbax-checkpoint) and is imported explicitly:
``from jaxcoll import dp``.
"""

from . import algorithms as algorithms
from . import dist as dist
from . import groups as groups
from . import primitives as primitives
from ._core.ops import ReduceOp as ReduceOp
from ._core.typing import AxisName as AxisName
from ._core.typing import PyTree as PyTree
from ._watch import handle_preemption as handle_preemption
from ._watch import preemption_point as preemption_point
from ._watch import preemption_requested as preemption_requested
from ._watch import watch as watch
from ._watch import watch_outputs as watch_outputs
from ._xla_flags import xla_cpu_flags as xla_cpu_flags
from .dist import init as init

__version__ = "0.1.0"

__all__ = [
    "AxisName",
    "PyTree",
    "ReduceOp",
    "algorithms",
    "dist",
    "groups",
    "handle_preemption",
    "init",
    "preemption_point",
    "preemption_requested",
    "primitives",
    "watch",
    "watch_outputs",
    "xla_cpu_flags",
]
