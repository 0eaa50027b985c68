"""Process groups as device groups: world, new_group, new_subgroups, hierarchy, and queries.

In ``jaxcoll.distributed`` a rank is a device: global rank ``i`` is ``jax.devices()[i]`` (in a
multi-process run the devices of every process, in JAX's global order).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._core.checks import check_rank, check_static_int, is_list
from ..groups import Group

_OUTER = "subgroup"


def _check_axis_name(api: str, axis_name: str) -> str:
    if not isinstance(axis_name, str) or not axis_name or axis_name == _OUTER:
        raise ValueError(
            f"{api}: axis_name={axis_name!r} must be a non-empty string other than "
            f"{_OUTER!r} (that name is used for the outer mesh axis)."
        )
    return axis_name


def world(*, axis_name: str = "x") -> Group:
    """The group of every device (torch's default group, ``group.WORLD``).

    Args:
        axis_name: the mesh axis this group stands for when passed as ``axis_name`` to a
            primitive inside your own ``shard_map`` (and the name used on its own mesh).

    Returns:
        A :class:`~jaxcoll.groups.Group` with ranks ``0..jax.device_count()-1``.

    Example (8 devices)::

        >>> dist.world().ranks
        (0, 1, 2, 3, 4, 5, 6, 7)
    """
    return _world(jax.device_count(), _check_axis_name("world", axis_name))


@functools.lru_cache(maxsize=1)
def _default_world() -> Group:
    """``world()``, built once: the device count is fixed once JAX's backend is up."""
    return world()


@functools.lru_cache(maxsize=16)
def _world(n: int, axis_name: str) -> Group:
    """One Group object per world size and name: the default group of every dist call."""
    ranks = tuple(range(n))
    return Group(ranks, (n,), (axis_name,), axis_name, (ranks,))


def new_group(ranks: Sequence[int], *, axis_name: str = "x") -> Group:
    """A group of the given global ranks, in ascending order (group rank j is the j-th
    smallest), as ``torch.distributed.new_group(ranks)`` orders them.

    A collective on the group runs on the member devices only, as one ``shard_map`` over a
    mesh of those devices. For a group whose ranks keep the order given, use
    :func:`ordered_group`.

    Args:
        ranks: distinct global ranks (device indices), any order, any subset.
        axis_name: the mesh axis name (see :func:`world`).

    Returns:
        A Group of ``len(ranks)`` ranks.

    Raises:
        ValueError: ``ranks`` is empty, repeats a rank, or names a rank that does not exist.

    Example (8 devices)::

        >>> g = dist.new_group([6, 1, 5])
        >>> g.ranks, dist.get_world_size(g)
        ((1, 5, 6), 3)
    """
    api = "dist.new_group"
    return _group_of(api, tuple(sorted(_check_ranks(api, ranks))), axis_name)


def ordered_group(ranks: Sequence[int], *, axis_name: str = "x") -> Group:
    """A group of the given global ranks in the order given: group rank j is ``ranks[j]``.

    jaxcoll's own (torch's ``new_group`` sorts, and so does :func:`new_group`): e.g. a ring
    whose neighbours are not in ascending device order.

    Example (8 devices)::

        >>> dist.ordered_group([6, 1, 5]).ranks
        (6, 1, 5)
    """
    api = "dist.ordered_group"
    return _group_of(api, _check_ranks(api, ranks), axis_name)


def _check_ranks(api: str, ranks: Any) -> tuple[int, ...]:
    if not is_list(ranks):
        raise TypeError(f"{api}: ranks must be a sequence of ints, got {ranks!r} instead.")
    ranks = tuple(check_static_int(api, "ranks entry", r) for r in ranks)
    if not ranks:
        raise ValueError(
            f"{api}: ranks=[] is empty; a group needs at least one rank, e.g. dist.new_group([0])."
        )
    dup = sorted({r for r in ranks if ranks.count(r) > 1})
    if dup:
        raise ValueError(f"{api}: ranks={list(ranks)} repeats rank {dup[0]}; list each rank once.")
    n = jax.device_count()
    bad = [r for r in ranks if not 0 <= r < n]
    if bad:
        raise ValueError(
            f"{api}: rank {bad[0]} in ranks={list(ranks)} is out of range for a "
            f"world of {n} ranks (0..{n - 1}). Pass ranks between 0 and {n - 1}."
        )
    return ranks


def _group_of(api: str, ranks: tuple[int, ...], axis_name: str) -> Group:
    axis_name = _check_axis_name(api, axis_name)
    return Group(ranks, (len(ranks),), (axis_name,), axis_name, (ranks,))


def new_subgroups(group_size: int, *, axis_name: str = "x") -> Group:
    """Split the world into disjoint groups of ``group_size`` consecutive ranks.

    Like ``torch.distributed.new_subgroups(group_size)``, which returns the caller's subgroup
    and the list of all of them. Here one Group holds the whole partition: a collective on it
    runs in every subgroup at once (a ``shard_map`` over a ``(world / group_size, group_size)``
    mesh, collective along the second axis), and a per-rank array for it has one row per
    device in global order.

    Args:
        group_size: ranks per subgroup; must divide the world size.
        axis_name: the mesh axis name within each subgroup (see :func:`world`).

    Returns:
        A Group of size ``group_size`` with ``world / group_size`` subgroups.

    Raises:
        ValueError: ``group_size`` is not positive or does not divide the world size.

    Example (8 devices)::

        >>> dist.new_subgroups(2).subgroups
        ((0, 1), (2, 3), (4, 5), (6, 7))
    """
    api = "dist.new_subgroups"
    k, n = _equal_split(
        api,
        "group_size",
        group_size,
        "groups",
        "Pass one of {divisors}, or use dist.new_group(ranks).",
    )
    axis_name = _check_axis_name(api, axis_name)
    subs = tuple(tuple(range(g * k, (g + 1) * k)) for g in range(n // k))
    return Group(tuple(range(n)), (n // k, k), (_OUTER, axis_name), axis_name, subs)


def _equal_split(api: str, argname: str, size: Any, parts: str, fix: str) -> tuple[int, int]:
    """``size`` must split the world into equal ``parts``; return (size, world size)."""
    k = check_static_int(api, argname, size)
    n = jax.device_count()
    if k <= 0 or n % k:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"{api}: {argname}={k} does not divide the world of {n} ranks into "
            f"equal {parts}. " + fix.format(divisors=divisors)
        )
    return k, n


class Hierarchy(NamedTuple):
    """The two groups of a 2-D (node, local) view of the world (see :func:`hierarchy`)."""

    node: Group
    local: Group


def hierarchy(local_size: int, *, axis_names: tuple[str, str] = ("node", "local")) -> Hierarchy:
    """A 2-D view of the world: ``world / local_size`` nodes of ``local_size`` ranks each.

    Global rank ``i`` sits at node ``i // local_size``, local rank ``i % local_size``. Both
    groups run over the same ``(nodes, local_size)`` mesh with axes ``axis_names``:
    ``local`` combines the ranks of each node (like an intra-node NCCL group), ``node``
    combines the ranks with the same local index across nodes (the inter-node group of a
    hierarchical all-reduce). Per-rank arrays for either have one row per device in global
    order. Inside your own ``shard_map`` over that mesh, the groups are the mesh axes.

    Args:
        local_size: ranks per node; must divide the world size.
        axis_names: names of the (node, local) mesh axes.

    Returns:
        A :class:`Hierarchy` ``(node, local)`` of Groups.

    Example (8 devices)::

        >>> h = dist.hierarchy(4)
        >>> dist.get_world_size(h.node), dist.get_world_size(h.local)
        (2, 4)
    """
    api = "dist.hierarchy"
    k, n = _equal_split(api, "local_size", local_size, "nodes", "Pass one of {divisors}.")
    if (
        not isinstance(axis_names, tuple)
        or len(axis_names) != 2
        or not all(isinstance(a, str) and a for a in axis_names)
        or axis_names[0] == axis_names[1]
    ):
        raise ValueError(
            f"{api}: axis_names={axis_names!r} must be two distinct non-empty "
            f"strings, e.g. ('node', 'local')."
        )
    ranks = tuple(range(n))
    shape = (n // k, k)
    node = Group(ranks, shape, axis_names, axis_names[0], (tuple(range(n // k)),))
    local = Group(ranks, shape, axis_names, axis_names[1], (tuple(range(k)),))
    return Hierarchy(node, local)


def resolve_group(api: str, group: Group | None) -> Group:
    """``group`` itself, or :func:`world` for None; TypeError for anything else."""
    if group is None:
        return _default_world()
    if not isinstance(group, Group):
        raise TypeError(
            f"{api}: group must be a Group from dist.world(), dist.new_group(...), "
            f"dist.new_subgroups(...) or dist.hierarchy(...), or None for the world; "
            f"got {group!r} of type {type(group).__name__} instead."
        )
    return group


@functools.lru_cache(maxsize=256)
def group_sharding(group: Group) -> NamedSharding:
    """Where a per-rank array for ``group`` lives: row i on the device of ``group.ranks[i]``."""
    return NamedSharding(group.mesh, P(group.mesh_axes))


def group_root(
    api: str, group: Group, rank: Any, group_rank: Any, name: str, default: int | None = None
) -> int:
    """The group rank of a root given as torch gives it: ``name`` (``src``/``dst``) a GLOBAL
    rank, or ``group_<name>`` a rank within the group; one of them, not both. With neither,
    the root is the global rank ``default`` (torch's ``scatter`` and ``gather`` default to
    global rank 0), or, for ops without a default, an error."""
    if rank is not None and group_rank is not None:
        raise ValueError(
            f"{api}: pass {name}= (a global rank) or group_{name}= (a rank within "
            f"the group), not both; got {name}={rank!r}, group_{name}="
            f"{group_rank!r}."
        )
    if group_rank is not None:
        return check_rank(api, f"group_{name}", group_rank, group.size)
    default_note = ""
    if rank is None:
        if default is None:
            raise ValueError(
                f"{api}: pass {name}= (a global rank) or group_{name}= (a rank within the group)."
            )
        rank = default
        default_note = f"torch's default when neither {name}= nor group_{name}= is given"
    rank = check_static_int(api, name, rank)
    if len(group.subgroups) > 1:
        shown = f"{name}={rank} ({default_note})" if default_note else f"{name}={rank}"
        raise ValueError(
            f"{api}: {shown} names one global rank, but {group!r} is a partition "
            f"whose subgroups each need their own root; pass group_{name}= (the "
            f"rank within each subgroup) instead."
        )
    if rank not in group.ranks:
        why = f"; {name}={rank} is {default_note}" if default_note else ""
        raise ValueError(
            f"{api}: Global rank {rank} is not part of group {group!r} (its "
            f"global ranks: {list(group.ranks)}){why}. Pass a member's global "
            f"rank as {name}=, or a rank within the group as group_{name}=."
        )
    return group.ranks.index(rank)


def get_world_size(group: Group | None = None) -> int:
    """The number of ranks in ``group`` (in each subgroup of a partition); the world if None.

    Like ``torch.distributed.get_world_size(group)``.

    Example (8 devices)::

        >>> dist.get_world_size(), dist.get_world_size(dist.new_group([1, 5, 6]))
        (8, 3)
    """
    return resolve_group("dist.get_world_size", group).size


def local_ranks(group: Group | None = None) -> list[int]:
    """The rows of a per-rank array for ``group`` whose devices this process drives.

    torch's ``get_rank()`` names the one device a process drives. A JAX process usually drives
    several (all the GPUs of a host), so there is no single answer; this is the list. With one
    process it is every row. For a single group, row j is group rank j.

    Example (8 devices, one process)::

        >>> dist.local_ranks(dist.new_group([5, 1]))
        [0, 1]
    """
    group = resolve_group("dist.local_ranks", group)
    devices = jax.devices()
    me = jax.process_index()
    return [i for i, r in enumerate(group.ranks) if devices[r].process_index == me]


def is_initialized() -> bool:
    """True once ``jax.distributed.initialize`` (or ``jaxcoll.init``) has run in this process.

    Unlike torch, a single-process run needs no initialization: every ``dist`` call works
    without it. The check touches no device, so it is safe before initializing.
    """
    return bool(jax.distributed.is_initialized())
