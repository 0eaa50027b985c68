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
    check_axis,
    check_gather_axis,
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
    compute = _ON_ROWS[primitive]
    kwargs.pop("algorithm", None)
    prepared = compute(api, None, None, lay.k, leaves=leaves, **kwargs)  # check args first
    me = jnp.asarray(lay.member)[r]
    j = jnp.maximum(jnp.asarray(lay.grank)[r], 0)
    idx = jnp.asarray(lay.rows)[r]
    out = []
    for leaf, prep in zip(leaves, prepared, strict=True):
        rows = jnp.take(lax.all_gather(leaf, ax.name), idx, axis=0)  # (k, *s), group order
        res = compute(api, rows, j, lay.k, prep=prep, **kwargs)
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


# The reference computation of each op on the member rows ``(k, *s)`` in group order, for
# group rank ``j``. Each is called twice: first with rows=None to check the arguments against
# the leaves (returning one prepared value per leaf), then per leaf with the rows.


def _reduce_prep(
    api: str, leaves: Sequence[jax.Array], op: ReduceOp | str, k: int, dst: int | None = None
) -> list[tuple[ReduceOp, str]]:
    rop = coerce_op(api, op)
    if dst is not None:
        check_rank(api, "dst", dst, k)
    return [(rop, check_op_dtype(api, rop, leaf.dtype)) for leaf in leaves]


def _all_reduce(
    api: str,
    rows: jax.Array | None,
    j: jax.Array | None,
    k: int,
    *,
    leaves: Sequence[jax.Array] = (),
    prep: Any = None,
    op: ReduceOp | str = ReduceOp.SUM,
) -> Any:
    if rows is None:
        return _reduce_prep(api, leaves, op, k)
    rop, kind = prep
    return fold(rop, kind, rows)


def _reduce(
    api: str,
    rows: jax.Array | None,
    j: jax.Array | None,
    k: int,
    *,
    leaves: Sequence[jax.Array] = (),
    prep: Any = None,
    dst: int = 0,
    op: ReduceOp | str = ReduceOp.SUM,
) -> Any:
    if rows is None:
        return _reduce_prep(api, leaves, op, k, dst)
    rop, kind = prep
    return fold(rop, kind, rows), j == dst


def _broadcast(
    api: str,
    rows: jax.Array | None,
    j: jax.Array | None,
    k: int,
    *,
    leaves: Sequence[jax.Array] = (),
    prep: Any = None,
    src: int = 0,
) -> Any:
    if rows is None:
        check_rank(api, "src", src, k)
        return [None] * len(leaves)
    return rows[src]


def _all_gather(
    api: str,
    rows: jax.Array | None,
    j: jax.Array | None,
    k: int,
    *,
    leaves: Sequence[jax.Array] = (),
    prep: Any = None,
    axis: int = 0,
    tiled: bool = False,
) -> Any:
    if rows is None:
        return [check_gather_axis(api, leaf.shape, axis, bool(tiled)) for leaf in leaves]
    return place_gathered(rows, prep, bool(tiled))


def _gather(
    api: str,
    rows: jax.Array | None,
    j: jax.Array | None,
    k: int,
    *,
    leaves: Sequence[jax.Array] = (),
    prep: Any = None,
    dst: int = 0,
    axis: int = 0,
    tiled: bool = False,
) -> Any:
    if rows is None:
        check_rank(api, "dst", dst, k)
        return _all_gather(api, None, j, k, leaves=leaves, axis=axis, tiled=tiled)
    return place_gathered(rows, prep, bool(tiled)), j == dst


def _slice(x: jax.Array, axis: int, k: int, tiled: bool, j: jax.Array | None) -> jax.Array:
    return unsplit_slice(split_leading(x, axis, k, tiled)[j], axis, tiled)


def _scatter(
    api: str,
    rows: jax.Array | None,
    j: jax.Array | None,
    k: int,
    *,
    leaves: Sequence[jax.Array] = (),
    prep: Any = None,
    src: int = 0,
    axis: int = 0,
    tiled: bool = False,
) -> Any:
    if rows is None:
        check_rank(api, "src", src, k)
        return [check_split(api, leaf.shape, axis, k, bool(tiled)) for leaf in leaves]
    return _slice(rows[src], prep, k, bool(tiled), j)


def _reduce_scatter(
    api: str,
    rows: jax.Array | None,
    j: jax.Array | None,
    k: int,
    *,
    leaves: Sequence[jax.Array] = (),
    prep: Any = None,
    op: ReduceOp | str = ReduceOp.SUM,
    scatter_dimension: int = 0,
    tiled: bool = False,
) -> Any:
    if rows is None:
        ops = _reduce_prep(api, leaves, op, k)
        dims = [
            check_split(api, leaf.shape, scatter_dimension, k, bool(tiled), "scatter_dimension")
            for leaf in leaves
        ]
        return [(*o, d) for o, d in zip(ops, dims, strict=True)]
    rop, kind, dim = prep
    return _slice(fold(rop, kind, rows), dim, k, bool(tiled), j)


def _all_to_all(
    api: str,
    rows: jax.Array | None,
    j: jax.Array | None,
    k: int,
    *,
    leaves: Sequence[jax.Array] = (),
    prep: Any = None,
    split_axis: int = 0,
    concat_axis: int = 0,
    tiled: bool = False,
) -> Any:
    if rows is None:
        return [
            (
                check_split(api, leaf.shape, split_axis, k, bool(tiled), "split_axis"),
                check_axis(api, "concat_axis", concat_axis, leaf.ndim),
            )
            for leaf in leaves
        ]
    s, c = prep
    pieces = jnp.stack([_slice(rows[m], s, k, bool(tiled), j) for m in range(k)])
    return place_gathered(pieces, c, bool(tiled))


_ON_ROWS: dict[Callable[..., Any], Callable[..., Any]] = {
    primitives.all_reduce: _all_reduce,
    primitives.reduce: _reduce,
    primitives.broadcast: _broadcast,
    primitives.all_gather: _all_gather,
    primitives.gather: _gather,
    primitives.scatter: _scatter,
    primitives.reduce_scatter: _reduce_scatter,
    primitives.all_to_all: _all_to_all,
}
