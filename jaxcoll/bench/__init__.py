"""``jaxcoll-bench``: an nccl-tests-style benchmark of jaxcoll's collectives and algorithms.

One job per module:

* :mod:`.cli`: the command line and :func:`main` (the usage is in its docstring);
* :mod:`.runner`: the loop over op x algorithm x size;
* :mod:`.cases`: each op's jitted program, input, NumPy oracle and busbw factor;
* :mod:`.timing`: the timing loop, :func:`malloc_tune` and the memory-copy ceiling;
* :mod:`.devices`: JAX's setup, the mesh, values gathered from every process;
* :mod:`.output`: the printed table, CSV and JSON;
* :mod:`.plot`: busbw against size;
* :mod:`.tuning`: ``--update-table``, writing the user's ``auto`` table.
"""

from .cli import main as main
from .cli import parse_args as parse_args
from .cli import parse_bytes as parse_bytes
from .runner import run as run
from .timing import malloc_tune as malloc_tune
from .timing import memcpy_gbps as memcpy_gbps

__all__ = ["main", "malloc_tune", "memcpy_gbps", "parse_args", "parse_bytes", "run"]
