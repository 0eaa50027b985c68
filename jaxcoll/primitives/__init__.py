"""SPMD collectives: call them inside ``jax.shard_map`` over a device mesh.

Each takes ``axis_name`` (a mesh axis or a tuple of them, as in ``jax.lax``, or a group from
:mod:`jaxcoll.distributed`) and a pytree, and returns new arrays. See each function for its
lowering.
Each public function is thin: it checks its arguments, chooses an algorithm
(:mod:`jaxcoll.algorithms`) and calls the lowering (:mod:`jaxcoll._core.lowering`). They live
in private modules, one family each (``_all_reduce``, ``_gather``, ``_ragged``, ...); import
them from here.
"""

from ._all_reduce import all_reduce as all_reduce
from ._all_reduce import reduce as reduce
from ._all_to_all import all_to_all as all_to_all
from ._broadcast import broadcast as broadcast
from ._gather import all_gather as all_gather
from ._gather import gather as gather
from ._p2p import sendrecv as sendrecv
from ._p2p import shift as shift
from ._ragged import all_gather_uneven as all_gather_uneven
from ._ragged import gather_uneven as gather_uneven
from ._ragged import ragged_all_to_all as ragged_all_to_all
from ._ragged import reduce_scatter_uneven as reduce_scatter_uneven
from ._ranks import rank as rank
from ._ranks import world_size as world_size
from ._reduce_scatter import reduce_scatter as reduce_scatter
from ._scan import exscan as exscan
from ._scan import scan as scan
from ._scatter import scatter as scatter

__all__ = [
    "all_gather",
    "all_gather_uneven",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "exscan",
    "gather",
    "gather_uneven",
    "ragged_all_to_all",
    "rank",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_uneven",
    "scan",
    "scatter",
    "sendrecv",
    "shift",
    "world_size",
]
