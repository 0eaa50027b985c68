"""Groups: a subset (or a partition) of ranks that a collective runs over.

A :class:`Group` is the one concept behind both layers:

* ``jaxcoll.dist`` runs each collective as a jitted ``shard_map`` over the group's own devices
  (:attr:`Group.mesh`), so a member-only collective costs what a world one does.
* Inside a user's own ``jax.shard_map``, every primitive accepts a Group as ``axis_name``:
  members get the group's result, non-members keep their input. Groups that cover their mesh
  axis in order (``dist.world()`` on a mesh of the same size, the groups of ``dist.hierarchy``)
  lower to the plain collective over that axis. Any other subset or partition lowers to one
  ``lax.all_gather`` over the whole axis followed by a local computation on the member rows in
  group order (``sendrecv`` and ``shift`` to one ``lax.ppermute`` with the ranks mapped). The
  gather moves n times the data of a native group collective: a correct fallback, not a fast
  one. ``lax``'s ``axis_index_groups`` is not used: ``psum`` rejects it inside ``shard_map``.

This module imports nothing from the primitive modules at import time, because they import it
(each public primitive starts with ``if is_group(axis_name): return group_op(...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._checks import (
    as_array_leaves,
    check_axis,
    check_divisible,
    check_leading,
    check_pairs,
    check_rank,
    check_static_int,
)
from .._ops import ReduceOp, check_op_dtype, coerce_op, fold

__all__ = ["Group", "group_op", "is_group"]


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

    def __repr__(self) -> str:
        if len(self.subgroups) == 1:
            return f"Group(ranks={list(self.ranks)}, axis_name={self.axis_name!r})"
        return (f"Group(subgroups={[list(s) for s in self.subgroups]}, "
                f"axis_name={self.axis_name!r})")


def is_group(axis_name: Any) -> bool:
    """True if ``axis_name`` is a :class:`Group` (the primitives then call :func:`group_op`)."""
    return isinstance(axis_name, Group)


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


def _is_full(group: Group, n: int) -> bool:
    return len(group.subgroups) == 1 and group.subgroups[0] == tuple(range(n))


def group_op(api: str, x: Any, group: Group, **kwargs: Any) -> Any:
    """Run primitive ``api`` over ``group`` inside ``shard_map`` (see the module docstring).

    Members get the group's result. Non-members keep ``x`` where the result has ``x``'s shape
    and dtype, and get zeros of the result's shape otherwise (all_gather, gather, scatter,
    reduce_scatter, untiled all_to_all). ``rank`` gives -1 on non-members.
    """
    # Imported here: the primitive modules import this one.
    from .. import primitives
    from . import _axis

    ax = _axis.resolve(api, group.axis_name)
    if api == "world_size":
        _layout(api, group, ax.size)
        return group.size
    if _is_full(group, ax.size):
        fn = getattr(primitives, api)
        return fn(group.axis_name) if api == "rank" else fn(x, group.axis_name, **kwargs)
    lay = _layout(api, group, ax.size)
    r = ax.rank()
    if api == "rank":
        return jnp.asarray(lay.grank)[r]
    if api in ("sendrecv", "shift"):
        return _permute(api, x, group, ax, lay, **kwargs)
    me = jnp.asarray(lay.member)[r]
    j = jnp.maximum(jnp.asarray(lay.grank)[r], 0)
    idx = jnp.asarray(lay.rows)[r]
    leaves, treedef = as_array_leaves(api, x)
    compute = _GENERAL[api]
    prepared = compute(api, None, None, lay.k, leaves=leaves, **kwargs)  # check args first
    out = []
    for leaf, prep in zip(leaves, prepared, strict=True):
        rows = jnp.take(lax.all_gather(leaf, ax.name), idx, axis=0)  # (k, *s), group order
        res = compute(api, rows, j, lay.k, prep=prep, **kwargs)
        if isinstance(res, tuple):  # (result, member mask override): rooted ops
            res, keep = res
            me_here = me & keep
        else:
            me_here = me
        if res.shape == leaf.shape and res.dtype == leaf.dtype:
            other = leaf
        else:
            other = jnp.zeros_like(res)
        out.append(jnp.where(me_here, res, other))
    return jax.tree_util.tree_unflatten(treedef, out)


def _permute(api: str, x: Any, group: Group, ax: Any, lay: _Layout, **kwargs: Any) -> Any:
    from .p2p import sendrecv

    k = lay.k
    if api == "sendrecv":
        pairs = check_pairs(api, kwargs["pairs"], k)
    else:
        offset = check_static_int(api, "offset", kwargs.get("offset", 1)) % k
        pairs = tuple((i, (i + offset) % k) for i in range(k)) if offset else ()
    mapped = [(sub[a], sub[b]) for sub in group.subgroups for a, b in pairs]
    return sendrecv(x, ax.name, mapped)


# Each general op is called twice: first with rows=None to check the arguments against the
# leaves (returning one prepared value per leaf), then per leaf with the member rows.


def _reduce_prep(api, leaves, op, k, dst=None):
    op = coerce_op(api, op)
    if dst is not None:
        check_rank(api, "dst", dst, k)
    return op, [check_op_dtype(api, op, leaf.dtype) for leaf in leaves]


def _all_reduce(api, rows, j, k, *, leaves=None, prep=None, op=ReduceOp.SUM):
    if rows is None:
        op, kinds = _reduce_prep(api, leaves, op, k)
        return [(op, kind) for kind in kinds]
    return fold(prep[0], prep[1], rows)


def _reduce(api, rows, j, k, *, leaves=None, prep=None, dst=0, op=ReduceOp.SUM):
    if rows is None:
        op, kinds = _reduce_prep(api, leaves, op, k, dst)
        return [(op, kind) for kind in kinds]
    return fold(prep[0], prep[1], rows), j == dst


def _broadcast(api, rows, j, k, *, leaves=None, prep=None, src=0):
    if rows is None:
        check_rank(api, "src", src, k)
        return [None] * len(leaves)
    return rows[src]


def _gather_axis(api, leaves, axis, tiled):
    axis = check_static_int(api, "axis", axis)
    out = []
    for leaf in leaves:
        if tiled and leaf.ndim == 0:
            raise ValueError(f"{api}: tiled=True concatenates along an existing axis, but x is a "
                             f"scalar. Use tiled=False to stack, or reshape x to 1-D.")
        out.append(check_axis(api, "axis", axis, leaf.ndim + (0 if tiled else 1)))
    return out


def _stack(rows, k, axis, tiled):
    if tiled:
        return jnp.concatenate([rows[i] for i in range(k)], axis=axis)
    return jnp.moveaxis(rows, 0, axis)


def _all_gather(api, rows, j, k, *, leaves=None, prep=None, axis=0, tiled=False):
    if rows is None:
        return _gather_axis(api, leaves, axis, tiled)
    return _stack(rows, k, prep, tiled)


def _gather(api, rows, j, k, *, leaves=None, prep=None, dst=0, axis=0, tiled=False):
    if rows is None:
        check_rank(api, "dst", dst, k)
        return _gather_axis(api, leaves, axis, tiled)
    return _stack(rows, k, prep, tiled), j == dst


def _split_axis(api, leaf, axis, k, tiled, argname, what):
    if leaf.ndim == 0:
        raise ValueError(f"{api}: x is a scalar, but it must hold {k} slices along {argname} "
                         f"(one per rank).")
    axis = check_axis(api, argname, axis, leaf.ndim)
    if tiled:
        check_divisible(api, f"x.shape[{axis}]{what}", leaf.shape[axis], k,
                        f"Pad {argname} to a multiple of the group size.")
    else:
        check_leading(api, f"x.shape[{axis}]{what}", leaf.shape[axis], k,
                      f"Put one slice per rank along {argname}, or use tiled=True.")
    return axis


def _slice(x, axis, k, tiled, j):
    from ._lowering import split_leading, unsplit_slice

    return unsplit_slice(split_leading(x, axis, k, tiled)[j], axis, tiled)


def _scatter(api, rows, j, k, *, leaves=None, prep=None, src=0, axis=0, tiled=False):
    if rows is None:
        check_rank(api, "src", src, k)
        return [_split_axis(api, leaf, axis, k, tiled, "axis", "") for leaf in leaves]
    return _slice(rows[src], prep, k, tiled, j)


def _reduce_scatter(api, rows, j, k, *, leaves=None, prep=None, op=ReduceOp.SUM,
                    scatter_dimension=0, tiled=False):
    if rows is None:
        op, kinds = _reduce_prep(api, leaves, op, k)
        dims = [_split_axis(api, leaf, scatter_dimension, k, tiled, "scatter_dimension", "")
                for leaf in leaves]
        return [(op, kind, d) for kind, d in zip(kinds, dims, strict=True)]
    op, kind, dim = prep
    return _slice(fold(op, kind, rows), dim, k, tiled, j)


def _all_to_all(api, rows, j, k, *, leaves=None, prep=None, split_axis=0, concat_axis=0,
                tiled=False):
    if rows is None:
        out = []
        for leaf in leaves:
            s = _split_axis(api, leaf, split_axis, k, tiled, "split_axis", " (split_axis)")
            out.append((s, check_axis(api, "concat_axis", concat_axis, leaf.ndim)))
        return out
    s, c = prep
    pieces = jnp.stack([_slice(rows[m], s, k, tiled, j) for m in range(k)])
    return _stack(pieces, k, c, tiled)


_GENERAL = {
    "all_reduce": _all_reduce,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
}
