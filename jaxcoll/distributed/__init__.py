"""torch.distributed's API on JAX devices: eager collectives on per-rank arrays.

A rank is a device (global rank i is ``jax.devices()[i]``). A per-rank array has one row per
rank of a group, row r on rank r's device (:func:`per_rank` builds one, :func:`to_ranks` reads
it back). Each collective is a cached, jitted ``jax.shard_map`` over the group's devices that
calls :mod:`jaxcoll.primitives`; ``async_op=True`` returns a :class:`Work`. Groups
(:func:`world`, :func:`new_group`, :func:`new_subgroups`, :func:`hierarchy`) are also accepted
as ``axis_name`` by the primitives inside your own ``shard_map``.

Example (8 devices)::

    >>> from jaxcoll import distributed as dist
    >>> x = dist.per_rank(lambda r: np.float32(r + 1))
    >>> dist.to_ranks(dist.all_reduce(x, op=dist.ReduceOp.MAX))[0]
    array(8., dtype=float32)
"""

from .._core.live import live_devices as live_devices
from .._core.ops import ReduceOp as ReduceOp
from ..groups import Group as Group
from ._collectives import all_gather as all_gather
from ._collectives import all_reduce as all_reduce
from ._collectives import all_to_all as all_to_all
from ._collectives import barrier as barrier
from ._collectives import broadcast as broadcast
from ._collectives import gather as gather
from ._collectives import irecv as irecv
from ._collectives import isend as isend
from ._collectives import recv as recv
from ._collectives import reduce as reduce
from ._collectives import reduce_scatter as reduce_scatter
from ._collectives import scatter as scatter
from ._collectives import send as send
from ._collectives import sendrecv as sendrecv
from ._group import Hierarchy as Hierarchy
from ._group import get_world_size as get_world_size
from ._group import hierarchy as hierarchy
from ._group import is_initialized as is_initialized
from ._group import local_ranks as local_ranks
from ._group import new_group as new_group
from ._group import new_subgroups as new_subgroups
from ._group import ordered_group as ordered_group
from ._group import world as world
from ._init import init as init
from ._objects import all_gather_object as all_gather_object
from ._objects import broadcast_object as broadcast_object
from ._objects import broadcast_object_list as broadcast_object_list
from ._objects import gather_object as gather_object
from ._objects import recv_object_list as recv_object_list
from ._objects import scatter_object_list as scatter_object_list
from ._objects import send_object_list as send_object_list
from ._per_rank import per_rank as per_rank
from ._per_rank import to_ranks as to_ranks
from ._ragged import all_gather_uneven as all_gather_uneven
from ._ragged import all_to_all_single as all_to_all_single
from ._ragged import gather_uneven as gather_uneven
from ._ragged import reduce_scatter_uneven as reduce_scatter_uneven
from ._scan import exscan as exscan
from ._scan import scan as scan
from ._work import Work as Work

__all__ = [
    "Group",
    "Hierarchy",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_object",
    "all_gather_uneven",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_object_list",
    "exscan",
    "gather",
    "gather_object",
    "gather_uneven",
    "get_world_size",
    "hierarchy",
    "init",
    "irecv",
    "is_initialized",
    "isend",
    "live_devices",
    "local_ranks",
    "new_group",
    "new_subgroups",
    "ordered_group",
    "per_rank",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_uneven",
    "scan",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "sendrecv",
    "to_ranks",
    "world",
]
