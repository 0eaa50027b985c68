"""Groups: a subset (or a partition) of ranks that a collective runs over.

A :class:`Group` is the one concept behind both layers:

* ``jaxcoll.distributed`` runs each collective as a jitted ``shard_map`` over the group's own
  devices (:attr:`Group.mesh`), so a member-only collective costs what a world one does.
* Inside a user's own ``jax.shard_map``, every primitive accepts a Group as ``axis_name``:
  members get the group's result, non-members keep their input. The primitive hands the call
  to the group (``Group.__jaxcoll_collective__``, see :mod:`jaxcoll._core.protocol`), so the
  primitives never import this module. Groups that cover their mesh axis in order
  (``dist.world()`` on a mesh of the same size, the groups of ``dist.hierarchy``) run the
  plain collective over that axis, with any ``algorithm=``. Any other subset or partition
  runs as one ``lax.all_gather`` over the whole axis, then the op's reference computation on
  the member rows in group order (the table ``_ON_ROWS``, keyed by the primitive);
  ``sendrecv`` and ``shift`` as one ``lax.ppermute`` with the ranks mapped.
  The gather moves n times the data of a native group collective: a correct fallback, not a
  fast one, and ``algorithm=`` other than ``"auto"``/``"native"`` is refused there.
  ``lax``'s ``axis_index_groups`` is not used: ``psum`` rejects it inside ``shard_map``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import primitives
from ._core.axis import Axis, resolve
from ._core.checks import (
    as_array_leaves,
    check_dim,
    check_gather_dim,
    check_pairs,
    check_rank,
    check_split,
    check_static_int,
)
from ._core.ops import ReduceOp, check_op_dtype, coerce_op, fold
from ._core.packing import place_gathered, split_leading, unsplit_slice
from .algorithms.registry import check_algorithm

__all__ = ["Group"]


@dataclass(frozen=True, eq=True)
class Group:
    """Ranks that run a collective together; build one with ``jaxcoll.distributed``.

    Use :func:`jaxcoll.distributed.world`, :func:`~jaxcoll.distributed.new_group`,
    :func:`~jaxcoll.distributed.new_subgroups` or :func:`~jaxcoll.distributed.hierarchy` rather
    than this constructor. Groups are immutable and hashable; equal groups share compiled programs.

    Attributes:
        ranks: the global ranks (indices into ``jax.devices()``) of the rows of a per-rank
            array for this group, in row order.
        mesh_shape: the shape of the device grid that ``ranks`` fills row-major.
        mesh_axes: the names of the grid's axes.
        axis_name: the mesh axis the collective runs over (one of ``mesh_axes``).
        subgroups: inside a user's ``shard_map``: the rank lists (positions along
            ``axis_name``, in group order) that each run the collective; ranks in no list are
            non-members.
    """

    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    axis_name: str
    subgroups: tuple[tuple[int, ...], ...]
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Groups key every cache of compiled programs: hash once, not on every call.
        object.__setattr__(
            self,
            "_hash",
            hash((self.ranks, self.mesh_shape, self.mesh_axes, self.axis_name, self.subgroups)),
        )

    def __hash__(self) -> int:
        return self._hash

    @property
    def size(self) -> int:
        """The number of ranks in the group (in each subgroup, for a partition)."""
        return len(self.subgroups[0])

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """A mesh over the group's devices: ``ranks`` laid out as ``mesh_shape``."""
        devices = jax.devices()
        grid = np.array([devices[r] for r in self.ranks], dtype=object)
        return jax.sharding.Mesh(grid.reshape(self.mesh_shape), self.mesh_axes)

    def group_rank(self, row: int) -> int:
        """The rank within its (sub)group of row ``row`` of a per-rank array."""
        coords = np.unravel_index(row, self.mesh_shape)
        return int(coords[self.mesh_axes.index(self.axis_name)])

    def __jaxcoll_collective__(self, primitive: Callable[..., Any], x: Any, **kwargs: Any) -> Any:
        """Run ``primitive`` (a :mod:`jaxcoll.primitives` function) over this group, inside
        ``shard_map``: the protocol of :mod:`jaxcoll._core.protocol`."""
        return _run(self, primitive, x, kwargs)

    def __repr__(self) -> str:
        if len(self.subgroups) == 1:
            return f"Group(ranks={list(self.ranks)}, axis_name={self.axis_name!r})"
        return f"Group(subgroups={[list(s) for s in self.subgroups]}, axis_name={self.axis_name!r})"


@dataclass(frozen=True)
class _Layout:
    """Static tables for one group on an axis of ``n`` positions."""

    n: int
    k: int
    member: np.ndarray  # (n,) bool
    grank: np.ndarray  # (n,) int32, -1 for non-members
    rows: np.ndarray  # (n, k) positions of each rank's subgroup, in group order


def _layout(api: str, group: Group, n: int) -> _Layout:
    k = group.size
    member = np.zeros(n, dtype=bool)
    grank = np.full(n, -1, dtype=np.int32)
    rows = np.tile(np.arange(n, dtype=np.int32)[:, None], (1, k))
    for sub in group.subgroups:
        if max(sub) >= n:
            raise ValueError(
                f"{api}: the group {group!r} names rank {max(sub)}, but axis "
                f"{group.axis_name!r} has only {n} ranks (0..{n - 1}) here. Build the group "
                f"from ranks of this axis, or run the shard_map over a mesh that has them."
            )
        for j, p in enumerate(sub):
            member[p] = True
            grank[p] = j
            rows[p] = sub
    return _Layout(n, k, member, grank, rows)


def _run(group: Group, primitive: Callable[..., Any], x: Any, kwargs: dict[str, Any]) -> Any:
    api = primitive.__name__
    ax = resolve(api, group.axis_name)
    lay = _layout(api, group, ax.size)
    if len(group.subgroups) == 1 and group.subgroups[0] == tuple(range(ax.size)):
        # The group is the axis, in order: the plain collective, any algorithm.
        if x is None:  # rank, world_size
            return primitive(group.axis_name)
        return primitive(x, group.axis_name, **kwargs)
    if primitive is primitives.world_size:
        return group.size
    r = ax.rank()
    if primitive is primitives.rank:
        return jnp.asarray(lay.grank)[r]
    if "algorithm" in kwargs:
        algorithm = check_algorithm(api, kwargs["algorithm"])
        if algorithm not in ("auto", "native"):
            raise ValueError(
                f"{api}: algorithm={algorithm!r} needs a group that covers its mesh axis in "
                f"order; {group!r} runs as one all_gather over axis {group.axis_name!r} plus "
                f"local work. Pass algorithm='auto', or a dist.world()/dist.hierarchy() group."
            )
        kwargs = {**kwargs, "algorithm": "native"}
    if primitive in (primitives.sendrecv, primitives.shift):
        return _permute(api, primitive, x, group, ax, lay, **kwargs)
    leaves, treedef = as_array_leaves(api, x)
    if primitive not in _ON_ROWS:  # the uneven ops and the scans have no row reference yet
        raise NotImplementedError(
            f"{api}: a group that is not its whole mesh axis in order is not supported "
            f"inside shard_map yet. Use jaxcoll.distributed on the group (it runs on the "
            f"member devices), or a mesh axis of the members."
        )
    check, on_rows = _ON_ROWS[primitive]
    kwargs.pop("algorithm", None)
    prepared = check(api, leaves, lay.k, **kwargs)  # check the arguments first
    me = jnp.asarray(lay.member)[r]
    j = jnp.maximum(jnp.asarray(lay.grank)[r], 0)
    idx = jnp.asarray(lay.rows)[r]
    out = []
    for leaf, prep in zip(leaves, prepared, strict=True):
        rows = jnp.take(lax.all_gather(leaf, ax.name), idx, axis=0)  # (k, *s), group order
        res = on_rows(rows, j, lay.k, prep, **kwargs)
        keep = me
        if isinstance(res, tuple):  # (result, which members get it): rooted ops
            res, keep = res[0], me & res[1]
        other = (
            leaf if (res.shape == leaf.shape and res.dtype == leaf.dtype) else jnp.zeros_like(res)
        )
        out.append(jnp.where(keep, res, other))
    return jax.tree_util.tree_unflatten(treedef, out)


def _permute(
    api: str,
    primitive: Callable[..., Any],
    x: Any,
    group: Group,
    ax: Axis,
    lay: _Layout,
    **kwargs: Any,
) -> Any:
    """sendrecv and shift over a group: one ppermute over the axis, the pairs mapped."""
    k = lay.k
    if primitive is primitives.sendrecv:
        pairs = check_pairs(api, kwargs["pairs"], k)
    else:
        offset = check_static_int(api, "offset", kwargs.get("offset", 1)) % k
        pairs = tuple((i, (i + offset) % k) for i in range(k)) if offset else ()
    mapped = [(sub[a], sub[b]) for sub in group.subgroups for a, b in pairs]
    return primitives.sendrecv(x, ax.name, mapped)


# The reference computation of each op over a group that is not its mesh axis in order, in two
# halves: ``check(api, leaves, k, **kwargs)`` checks the arguments against the leaves before
# anything runs and returns one prepared value per leaf; ``on_rows(rows, j, k, prep, **kwargs)``
# computes one leaf's result from the member rows ``(k, *s)`` in group order, for group rank
# ``j``, and returns it, or ``(result, which members keep it)`` for a rooted op. ``kwargs`` are
# the primitive's own (every one given: the primitives pass them all).


def _check_reduce(
    api: str, leaves: Sequence[jax.Array], k: int, *, op: Any, dst: Any = None
) -> list[tuple[ReduceOp, str]]:
    rop = coerce_op(api, op)
    if dst is not None:
        check_rank(api, "dst", dst, k)
    return [(rop, check_op_dtype(api, rop, leaf.dtype)) for leaf in leaves]


def _check_broadcast(api: str, leaves: Sequence[jax.Array], k: int, *, src: Any) -> list[None]:
    check_rank(api, "src", src, k)
    return [None] * len(leaves)


def _check_gather(
    api: str, leaves: Sequence[jax.Array], k: int, *, dim: Any, tiled: Any, dst: Any = None
) -> list[int]:
    if dst is not None:
        check_rank(api, "dst", dst, k)
    return [check_gather_dim(api, leaf.shape, dim, bool(tiled)) for leaf in leaves]


def _check_scatter(
    api: str, leaves: Sequence[jax.Array], k: int, *, src: Any, dim: Any, tiled: Any
) -> list[int]:
    check_rank(api, "src", src, k)
    return [check_split(api, leaf.shape, dim, k, bool(tiled)) for leaf in leaves]


def _check_reduce_scatter(
    api: str, leaves: Sequence[jax.Array], k: int, *, op: Any, scatter_dimension: Any, tiled: Any
) -> list[tuple[ReduceOp, str, int]]:
    ops = _check_reduce(api, leaves, k, op=op)
    dims = [
        check_split(api, leaf.shape, scatter_dimension, k, bool(tiled), "scatter_dimension")
        for leaf in leaves
    ]
    return [(*o, d) for o, d in zip(ops, dims, strict=True)]


def _check_all_to_all(
    api: str, leaves: Sequence[jax.Array], k: int, *, split_dim: Any, concat_dim: Any, tiled: Any
) -> list[tuple[int, int]]:
    return [
        (
            check_split(api, leaf.shape, split_dim, k, bool(tiled), "split_dim"),
            check_dim(api, "concat_dim", concat_dim, leaf.ndim),
        )
        for leaf in leaves
    ]


def _slice(x: jax.Array, dim: int, k: int, tiled: bool, j: jax.Array) -> jax.Array:
    """Slice ``j`` of the ``k`` along ``dim``, as scatter and reduce_scatter cut them."""
    return unsplit_slice(split_leading(x, dim, k, tiled)[j], dim, tiled)


def _all_to_all_rows(rows: jax.Array, j: jax.Array, k: int, prep: Any, tiled: Any) -> jax.Array:
    s, c = prep
    pieces = jnp.stack([_slice(rows[m], s, k, bool(tiled), j) for m in range(k)])
    return place_gathered(pieces, c, bool(tiled))


_ON_ROWS: dict[Callable[..., Any], tuple[Callable[..., Any], Callable[..., Any]]] = {
    primitives.all_reduce: (
        _check_reduce,
        lambda rows, j, k, prep, **kw: fold(prep[0], prep[1], rows),
    ),
    primitives.reduce: (
        _check_reduce,
        lambda rows, j, k, prep, *, dst, **kw: (fold(prep[0], prep[1], rows), j == dst),
    ),
    primitives.broadcast: (_check_broadcast, lambda rows, j, k, prep, *, src, **kw: rows[src]),
    primitives.all_gather: (
        _check_gather,
        lambda rows, j, k, prep, *, tiled, **kw: place_gathered(rows, prep, bool(tiled)),
    ),
    primitives.gather: (
        _check_gather,
        lambda rows, j, k, prep, *, dst, tiled, **kw: (
            place_gathered(rows, prep, bool(tiled)),
            j == dst,
        ),
    ),
    primitives.scatter: (
        _check_scatter,
        lambda rows, j, k, prep, *, src, tiled, **kw: _slice(rows[src], prep, k, bool(tiled), j),
    ),
    primitives.reduce_scatter: (
        _check_reduce_scatter,
        lambda rows, j, k, prep, *, tiled, **kw: _slice(
            fold(prep[0], prep[1], rows), prep[2], k, bool(tiled), j
        ),
    ),
    primitives.all_to_all: (
        _check_all_to_all,
        lambda rows, j, k, prep, *, tiled, **kw: _all_to_all_rows(rows, j, k, prep, tiled),
    ),
}
