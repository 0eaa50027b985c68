"""Groups: a subset (or a partition) of ranks that a collective runs over.

A :class:`Group` is the one concept behind both layers:

* ``jaxcoll.dist`` runs each collective as a jitted ``shard_map`` over the group's own devices
  (:attr:`Group.mesh`), so a member-only collective costs what a world one does.
* Inside a user's own ``jax.shard_map``, every primitive accepts a Group as ``axis_name``:
  members get the group's result, non-members keep their input. The primitive hands the call
  to the group (``Group.__jaxcoll_collective__``, see :mod:`jaxcoll._core.protocol`), so the
  primitives never import this module. Groups that cover their mesh axis in order
  (``dist.world()`` on a mesh of the same size, the groups of ``dist.hierarchy``) run the
  plain collective over that axis, with any ``algorithm=``. Any other subset or partition
  runs as one ``lax.all_gather`` over the whole axis, then the same primitive under
  ``jax.vmap`` over the member rows in group order (so its semantics and checks are the
  primitive's own); ``sendrecv`` and ``shift`` as one ``lax.ppermute`` with the ranks mapped.
  The gather moves n times the data of a native group collective: a correct fallback, not a
  fast one, and ``algorithm=`` other than ``"auto"``/``"native"`` is refused there.
  ``lax``'s ``axis_index_groups`` is not used: ``psum`` rejects it inside ``shard_map``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import primitives
from ._core.axis import Axis, resolve
from ._core.checks import as_array_leaves, check_pairs, check_static_int
from .algorithms.registry import check_algorithm

__all__ = ["Group"]

_VMAP_AXIS = "_jaxcoll_group_members"


@dataclass(frozen=True)
class Group:
    """Ranks that run a collective together; build one with ``jaxcoll.dist``.

    Use :func:`jaxcoll.dist.world`, :func:`~jaxcoll.dist.new_group`,
    :func:`~jaxcoll.dist.new_subgroups` or :func:`~jaxcoll.dist.hierarchy` rather than this
    constructor. Groups are immutable and hashable; equal groups share compiled programs.

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
        return (f"Group(subgroups={[list(s) for s in self.subgroups]}, "
                f"axis_name={self.axis_name!r})")


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
                f"local work. Pass algorithm='auto', or a dist.world()/dist.hierarchy() group.")
        kwargs = {**kwargs, "algorithm": "native"}
    if primitive in (primitives.sendrecv, primitives.shift):
        return _permute(api, primitive, x, group, ax, lay, **kwargs)
    leaves, treedef = as_array_leaves(api, x)
    # Every member row, in group order: row j is group rank j's value.
    idx = jnp.asarray(lay.rows)[r]
    rows = [jnp.take(lax.all_gather(leaf, ax.name), idx, axis=0) for leaf in leaves]

    def member(*values):  # the primitive itself, over the group's k ranks
        return primitive(jax.tree_util.tree_unflatten(treedef, values), _VMAP_AXIS, **kwargs)

    results = jax.vmap(member, axis_name=_VMAP_AXIS, axis_size=lay.k)(*rows)
    me = jnp.asarray(lay.member)[r]
    j = jnp.maximum(jnp.asarray(lay.grank)[r], 0)
    out = []
    for leaf, res in zip(leaves, jax.tree_util.tree_leaves(results), strict=True):
        mine = res[j]
        other = leaf if (mine.shape == leaf.shape and mine.dtype == leaf.dtype) \
            else jnp.zeros_like(mine)
        out.append(jnp.where(me, mine, other))
    return jax.tree_util.tree_unflatten(treedef, out)


def _permute(api: str, primitive: Callable[..., Any], x: Any, group: Group, ax: Axis,
             lay: _Layout, **kwargs: Any) -> Any:
    """sendrecv and shift over a group: one ppermute over the axis, the pairs mapped."""
    k = lay.k
    if primitive is primitives.sendrecv:
        pairs = check_pairs(api, kwargs["pairs"], k)
    else:
        offset = check_static_int(api, "offset", kwargs.get("offset", 1)) % k
        pairs = tuple((i, (i + offset) % k) for i in range(k)) if offset else ()
    mapped = [(sub[a], sub[b]) for sub in group.subgroups for a, b in pairs]
    return primitives.sendrecv(x, ax.name, mapped)
