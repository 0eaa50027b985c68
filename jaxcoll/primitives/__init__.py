"""SPMD collectives: call them inside ``jax.shard_map`` over a device mesh.

Each takes ``axis_name`` (a mesh axis or a tuple of them, as in ``jax.lax``, or a group from
:mod:`jaxcoll.distributed`) and a pytree, and returns new arrays. See each function for its
lowering.
Each public function is thin: it checks its arguments, chooses an algorithm
(:mod:`jaxcoll.algorithms`) and calls the lowering (:mod:`jaxcoll._core.lowering`).
"""

from .all_reduce import all_reduce as all_reduce
from .all_reduce import reduce as reduce
from .all_to_all import all_to_all as all_to_all
from .broadcast import broadcast as broadcast
from .gather import all_gather as all_gather
from .gather import gather as gather
from .p2p import sendrecv as sendrecv
from .p2p import shift as shift
from .ragged import all_gather_uneven as all_gather_uneven
from .ragged import gather_uneven as gather_uneven
from .ragged import ragged_all_to_all as ragged_all_to_all
from .ragged import reduce_scatter_uneven as reduce_scatter_uneven
from .ranks import rank as rank
from .ranks import world_size as world_size
from .reduce_scatter import reduce_scatter as reduce_scatter
from .scan import exscan as exscan
from .scan import scan as scan
from .scatter import scatter as scatter

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
