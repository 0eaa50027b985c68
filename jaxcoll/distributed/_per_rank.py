"""Per-rank arrays: one row per rank, row r on the device of rank r of the group."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.typing import ArrayLike

from ..groups import Group
from ._group import group_sharding, resolve_group


def per_rank(
    values: Sequence[ArrayLike] | Callable[[int], ArrayLike], group: Group | None = None
) -> jax.Array:
    """Build a per-rank array: row r holds ``values[r]`` on the device of row r of ``group``.

    Equivalent to ``jnp.stack([values[r] for r in range(n)])`` placed so that row r lives on
    device ``jax.devices()[group.ranks[r]]``. This is how a torch script's "each rank has its
    own tensor" is written in ``jaxcoll.distributed``: every collective takes and returns such
    arrays.

    Only the rows of devices this process drives are read (``values`` may be a function, so
    in a multi-process run each process builds only its own rows).

    Args:
        values: a sequence of n arrays of one shape and dtype, or a function ``row -> array``.
            n is ``len(group.ranks)``; for a single group, row r is group rank r.
        group: the group the array is for; the world if None.

    Returns:
        A ``jax.Array`` of shape ``(n, *values[0].shape)``.

    Raises:
        ValueError: ``values`` has the wrong length or its rows differ in shape or dtype.

    Example (8 devices)::

        >>> x = dist.per_rank(lambda r: np.full(2, r, np.float32))
        >>> x.shape
        (8, 2)
    """
    api = "dist.per_rank"
    group = resolve_group(api, group)
    sharding = group_sharding(group)
    n = len(group.ranks)
    devices = jax.devices()
    me = jax.process_index()
    mine = [i for i, r in enumerate(group.ranks) if devices[r].process_index == me]
    if callable(values):
        get = values
    else:
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(
                f"{api}: values must be a sequence of {n} arrays or a function "
                f"row -> array, got {type(values).__name__} instead."
            )
        if len(values) != n:
            raise ValueError(
                f"{api}: got {len(values)} values but the group has {n} rows "
                f"(ranks {list(group.ranks)}); pass exactly one value per row."
            )
        get = values.__getitem__
    if not mine:
        raise ValueError(
            f"{api}: this process drives none of the group's devices, so it cannot "
            f"tell the rows' shape; call dist collectives on this group only from "
            f"the processes that drive its ranks."
        )
    rows = {i: np.asarray(get(i)) for i in mine}
    first = rows[mine[0]]
    for i, row in rows.items():
        if row.shape != first.shape or row.dtype != first.dtype:
            raise ValueError(
                f"{api}: row {i} has shape {row.shape} and dtype {row.dtype}, but "
                f"row {mine[0]} has {first.shape} and {first.dtype}; every rank must "
                f"hold the same shape and dtype (pad or cast first)."
            )
    for i, row in rows.items():
        _check_survives(api, i, row)
    shards = [jax.device_put(rows[i][None], devices[group.ranks[i]]) for i in mine]
    return jax.make_array_from_single_device_arrays((n, *first.shape), sharding, shards)


def _check_survives(api: str, i: int, row: np.ndarray) -> None:
    """Raise unless ``row`` keeps its values in the dtype JAX will hold it in.

    Without ``jax_enable_x64`` JAX holds 64-bit data in 32 bits: integers must fit (2**40 + 1
    would silently become 1), floats must not overflow to inf (rounding, as ``jnp.asarray``
    rounds float64 to float32, is expected).
    """
    held = np.dtype(jax.dtypes.canonicalize_dtype(row.dtype))
    if held == row.dtype or row.size == 0:
        return
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = row.astype(held)
    if np.issubdtype(row.dtype, np.integer) or row.dtype == np.bool_:
        lost = narrow.astype(row.dtype) != row
    else:
        lost = np.isfinite(row) & ~np.isfinite(narrow)
    if lost.any():
        where = tuple(int(k) for k in np.argwhere(lost)[0])
        raise ValueError(
            f"{api}: row {i} holds {row.dtype} values that {held} cannot hold (e.g. "
            f"{row[where]!r} at {where}); JAX keeps 64-bit data in 32 bits unless "
            f"jax_enable_x64 is set. Enable it (jax.config.update('jax_enable_x64', True)) "
            f"before creating arrays, or pass values that fit {held}."
        )


def to_ranks(x: jax.Array) -> list[np.ndarray]:
    """The rows of ``x`` this process can address, as NumPy arrays, in row (rank) order.

    With one process that is every row: ``to_ranks(x)[r]`` is rank r's value. In a
    multi-process run each process gets the rows of its own devices (see :func:`local_ranks`
    for their indices). Waits for ``x`` to be computed.

    Example (8 devices)::

        >>> dist.to_ranks(dist.all_reduce(dist.per_rank(np.arange(8.0))))[3]
        array(28., dtype=float32)
    """
    if not isinstance(x, jax.Array):
        raise TypeError(
            f"dist.to_ranks: x must be a per-rank jax.Array, got {type(x).__name__} instead."
        )
    if x.ndim == 0:
        raise ValueError("dist.to_ranks: x is a scalar; a per-rank array has one row per rank.")
    rows: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        data = np.asarray(shard.data)
        for k in range(data.shape[0]):
            rows.setdefault(start + k, np.asarray(data[k]))
    return [rows[i] for i in sorted(rows)]


@functools.lru_cache(maxsize=256)
def _placed_like(sharding: Any, target: NamedSharding, ndim: int) -> bool:
    """Whether an array of ``ndim`` dims placed by ``sharding`` has one row per rank as
    ``target`` places it. Cached: the outputs of one dist program share their sharding object,
    so a repeated call finds it by identity."""
    if not isinstance(sharding, jax.sharding.Sharding) or ndim < 1:
        return False
    return sharding == target or sharding.is_equivalent_to(target, ndim)


def check_per_rank(api: str, x: Any, group: Group) -> list[jax.Array]:
    """Every leaf of ``x`` must be a per-rank array for ``group``; return the leaves."""
    leaves = jax.tree_util.tree_leaves(x)
    target = group_sharding(group)
    if len(leaves) == 1 and _placed_like(
        getattr(leaves[0], "sharding", None), target, getattr(leaves[0], "ndim", -1)
    ):
        return leaves  # the common case, one lookup: a dist result passed on
    if not leaves:
        raise ValueError(f"{api}: x has no arrays; pass a per-rank array from dist.per_rank.")
    n = len(group.ranks)
    for i, leaf in enumerate(leaves):
        where = "x" if len(leaves) == 1 else f"leaf {i} of x"
        if not isinstance(leaf, jax.Array):
            raise TypeError(
                f"{api}: {where} must be a per-rank jax.Array, got "
                f"{type(leaf).__name__} instead. Build it with "
                f"dist.per_rank(values, group=group)."
            )
        if leaf.ndim == 0 or leaf.shape[0] != n:
            got = "a scalar" if leaf.ndim == 0 else f"{leaf.shape[0]} rows"
            raise ValueError(
                f"{api}: {where} has {got} but the group {group!r} has {n} rows, "
                f"one per rank. Build it with dist.per_rank(values, group=group)."
            )
        if not _placed_like(leaf.sharding, target, leaf.ndim):
            raise ValueError(
                f"{api}: {where} is not placed one row per rank of {group!r} "
                f"(its sharding is {leaf.sharding}). Build it with "
                f"dist.per_rank(values, group=group), or pass the result of a "
                f"dist call on this group."
            )
    return leaves
