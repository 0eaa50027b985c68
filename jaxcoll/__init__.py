"""jaxcoll: torch.distributed's collective vocabulary as SPMD code over a JAX device mesh.

Importing jaxcoll queries no device and changes no setting. torch.distributed's eager API is
:mod:`jaxcoll.distributed`, imported as torch's is: ``from jaxcoll import distributed as dist``
(``jaxcoll.dist`` is the same module under its short name, so ``from jaxcoll import dist`` and
``import jaxcoll.dist`` work too). The data-parallel trainer needs the ``dp`` extra (flax,
optax, orbax-checkpoint) and is imported explicitly: ``from jaxcoll import dp``.
"""

import sys as _sys

from . import algorithms as algorithms
from . import distributed as dist
from . import distributed as distributed
from . import groups as groups
from . import parallel as parallel  # fills the roles' tables (schedules, attention routing)
from . import primitives as primitives
from ._core.ops import ReduceOp as ReduceOp
from ._core.typing import AxisName as AxisName
from ._core.typing import PyTree as PyTree
from ._watch import dump_trace as dump_trace
from ._watch import handle_preemption as handle_preemption
from ._watch import preemption_point as preemption_point
from ._watch import preemption_requested as preemption_requested
from ._watch import watch as watch
from ._watch import watch_outputs as watch_outputs
from ._xla_flags import compiler_options as compiler_options
from ._xla_flags import xla_cpu_flags as xla_cpu_flags
from ._xla_flags import xla_gpu_flags as xla_gpu_flags
from .distributed import init as init

# ``import jaxcoll.dist`` finds the same module object; nothing is loaded twice. (Private
# submodules are imported by their real path, ``jaxcoll.distributed._x``.)
_sys.modules[__name__ + ".dist"] = distributed

__version__ = "0.1.0"

__all__ = [
    "AxisName",
    "PyTree",
    "ReduceOp",
    "algorithms",
    "compiler_options",
    "dist",
    "distributed",
    "dump_trace",
    "groups",
    "handle_preemption",
    "init",
    "parallel",
    "preemption_point",
    "preemption_requested",
    "primitives",
    "watch",
    "watch_outputs",
    "xla_cpu_flags",
    "xla_gpu_flags",
]
