"""SPMD collectives: call them inside ``jax.shard_map`` over a device mesh.

Each takes ``axis_name`` (a mesh axis or a tuple of them, as in ``jax.lax``, or a group from
:mod:`jaxcoll.dist`) and a pytree, and returns new arrays. See each function for its lowering.
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
from .ranks import rank as rank
from .ranks import world_size as world_size
from .reduce_scatter import reduce_scatter as reduce_scatter
from .scatter import scatter as scatter

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather",
    "rank",
    "reduce",
    "reduce_scatter",
    "scatter",
    "sendrecv",
    "shift",
    "world_size",
]
