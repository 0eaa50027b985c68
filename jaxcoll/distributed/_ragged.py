"""Uneven collectives on per-rank arrays: all_to_all_single with split sizes, all_gather /
gather of tensors whose size differs per rank, and reduce_scatter into parts of different sizes.

A per-rank array has one shape for every rank, so a rank's uneven tensor is written as its row
padded to a common width plus its real size, given as host lists exactly as each torch rank
would pass them. The split sizes travel to the devices as data (one small per-rank int32
array, cached per table), so a new table of the same widths reuses the compiled program.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .. import primitives
from .._core.checks import check_sizes, check_static_int, is_list
from .._core.ops import ReduceOp, check_op_dtype, coerce_op
from .._core.scheduled import Scheduled
from .._core.typing import PyTree
from .._watch import process, watchdog
from ..groups import Group
from . import _inflight
from ._collectives import all_to_all
from ._group import group_root, resolve_group
from ._per_rank import check_per_rank, per_rank
from ._work import Work


def _watched(api: str, out: Any, x: PyTree) -> Any:
    """Hand ``out`` to the collective watchdog and the flight recorder, and count it in flight
    (as every dist call)."""
    if process.settings.on:
        watchdog.register(out, api, x)
    _inflight.admit(out)
    return out


@functools.lru_cache(maxsize=64)
def _subgroup_rows(group: Group) -> tuple[tuple[int, ...], ...]:
    """Per subgroup, the rows of a per-rank array in group-rank order."""
    axis = group.mesh_axes.index(group.axis_name)
    subs: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for row in range(len(group.ranks)):
        coords = np.unravel_index(row, group.mesh_shape)
        key = tuple(int(c) for i, c in enumerate(coords) if i != axis)
        subs.setdefault(key, []).append((int(coords[axis]), row))
    return tuple(tuple(row for _, row in sorted(v)) for v in subs.values())


def _width(api: str, x: PyTree, group: Group) -> int:
    """The common row width (axis 1 of every leaf) of a per-rank array for ``group``."""
    leaves = check_per_rank(api, x, group)
    widths = set()
    for leaf in leaves:
        if leaf.ndim < 2:
            raise ValueError(
                f"{api}: x has shape {leaf.shape}, one scalar per rank; each rank's "
                f"row must be a tensor to split along its first axis (shape "
                f"(rows, width, ...))."
            )
        widths.add(leaf.shape[1])
    if len(widths) > 1:
        raise ValueError(
            f"{api}: the leaves of x have row widths {sorted(widths)}; every leaf "
            f"must have the same width."
        )
    return widths.pop()


def _table(api: str, argname: str, value: Any, rows: int, k: int) -> tuple[tuple[int, ...], ...]:
    """A list of ``rows`` lists of ``k`` non-negative ints (row r: what rank r passes)."""
    shape = (
        f"a list of {rows} lists (one per rank, as each rank would pass it to torch) "
        f"of {k} ints each"
    )
    if not is_list(value, rows):
        raise ValueError(f"{api}: {argname} must be {shape}; got {value!r}.")
    out = []
    for r, row in enumerate(value):
        if not is_list(row, k):
            raise ValueError(
                f"{api}: {argname}[{r}]={row!r} must be a list of {k} ints (one "
                f"per rank of the group); {argname} must be {shape}."
            )
        ints = tuple(check_static_int(api, f"{argname}[{r}] entry", v) for v in row)
        if min(ints) < 0:
            raise ValueError(
                f"{api}: {argname}[{r}]={list(ints)} has a negative size; split "
                f"sizes count rows and must be >= 0."
            )
        out.append(ints)
    return tuple(out)


def _split_tables(api: str, ins: Any, outs: Any, group: Group, width: int):
    """Both tables, with torch's even split for a missing one, checked against each other."""
    rows, k = len(group.ranks), group.size
    subs = _subgroup_rows(group)
    grank = {row: j for sub in subs for j, row in enumerate(sub)}
    peer = {row: sub for sub in subs for row in sub}  # row -> its subgroup's rows
    if ins is None:
        if width % k:
            raise ValueError(
                f"{api}: input_split_sizes=None splits each rank's input evenly, "
                f"but x's rows have width {width}, not divisible by the group size "
                f"{k}. Pass input_split_sizes."
            )
        ins = tuple((width // k,) * k for _ in range(rows))
    else:
        ins = _table(api, "input_split_sizes", ins, rows, k)
    if outs is None:
        outs = tuple(tuple(ins[peer[r][j]][grank[r]] for j in range(k)) for r in range(rows))
        for r, row in enumerate(outs):
            if len(set(row)) > 1:
                raise ValueError(
                    f"{api}: output_split_sizes=None means rank {r} receives an equal part from "
                    f"every rank (torch splits the output evenly), but input_split_sizes sends "
                    f"it {list(row)} rows. Pass output_split_sizes."
                )
    else:
        outs = _table(api, "output_split_sizes", outs, rows, k)
    for r in range(rows):
        if sum(ins[r]) > width:
            raise ValueError(
                f"{api}: input_split_sizes[{r}]={list(ins[r])} sums to {sum(ins[r])}, more than "
                f"the width {width} of x's rows. Pad every rank's input to the longest (width >= "
                f"{max(sum(v) for v in ins)})."
            )
        for j, dst in enumerate(peer[r]):
            if ins[r][j] != outs[dst][grank[r]]:
                raise ValueError(
                    f"{api}: input_split_sizes[{r}][{j}]={ins[r][j]} but output_split_sizes"
                    f"[{dst}][{grank[r]}]={outs[dst][grank[r]]}: rank {r} sends {ins[r][j]} rows "
                    f"to rank {dst}, which expects {outs[dst][grank[r]]}. Make "
                    f"output_split_sizes[j][r] equal input_split_sizes[r][j]."
                )
    return ins, outs


@functools.lru_cache(maxsize=256)
def _sizes(group: Group, table: tuple[tuple[int, ...], ...]) -> jax.Array:
    return per_rank(lambda r: np.asarray(table[r], np.int32), group)


@functools.lru_cache(maxsize=256)
def _a2a_program(group: Group, out_width: int):
    spec = P(group.mesh_axes)

    def body(x, sizes):
        local = jax.tree_util.tree_map(lambda a: a[0], x)
        out, _ = primitives.ragged_all_to_all(local, group.axis_name, sizes[0], out_size=out_width)
        return jax.tree_util.tree_map(lambda a: a[None], out)

    return Scheduled(
        jax.jit(
            jax.shard_map(body, mesh=group.mesh, in_specs=(spec, spec), out_specs=spec),
        )
    )


def all_to_all_single(
    x: PyTree,
    output_split_sizes: Sequence[Sequence[int]] | None = None,
    input_split_sizes: Sequence[Sequence[int]] | None = None,
    group: Group | None = None,
    async_op: bool = False,
) -> PyTree | Work:
    """Rank r sends ``input_split_sizes[r][j]`` rows of its input to rank j, as torch does.

    ``torch.distributed.all_to_all_single(output, input, output_split_sizes,
    input_split_sizes, group, async_op)``, on per-rank arrays: row r of ``x`` (shape
    ``(n, width, ...)``) is rank r's input, padded to a common width; each split-size argument
    is a list of n lists, row r being what rank r would pass to torch. Row r of the result
    holds what torch's rank r receives, in rank order, then zero padding. Equivalent to::

        def all_to_all_single(x, output_split_sizes, input_split_sizes):
            rows = []
            for r in range(n):
                got = [x[j][sum(input_split_sizes[j][:r]):][:input_split_sizes[j][r]]
                       for j in range(n)]
                rows.append(jnp.concatenate(got))          # torch's output on rank r
            width = max(map(sum, output_split_sizes))
            return jnp.stack([pad(row, width) for row in rows])

    Without split sizes it is torch's even split (``tiled`` :func:`all_to_all`: row r gets
    chunk r of every rank's row). If one table is None, torch splits that side evenly: with
    ``input_split_sizes=None`` every rank sends ``width / n`` rows to each rank; with
    ``output_split_sizes=None`` each rank must receive equal parts from every rank.

    Lowering: :func:`jaxcoll.primitives.ragged_all_to_all` (GPU: one
    ``lax.ragged_all_to_all``; CPU: a padded ``all_to_all``), with the sizes as a per-rank
    int32 array: a new table of the same widths dispatches without recompiling. Any dtype;
    pytrees whose leaves share the width.

    Args:
        x: a per-rank array ``(n, width, ...)`` (or pytree of them) for ``group``.
        output_split_sizes: n lists of n ints, or None (see above).
        input_split_sizes: n lists of n ints, or None (see above).
        group: the group; the world if None. For a partition (``new_subgroups``,
            ``hierarchy``) the tables have one list per row of ``x``, each of group-size ints.
        async_op: return a :class:`~jaxcoll.distributed.Work`.

    Returns:
        A per-rank array of width ``max(sum(output_split_sizes[r]))``: torch's rank r output
        is ``y[r, :sum(output_split_sizes[r])]``.

    Raises:
        ValueError: a table of the wrong shape or with negative sizes, a rank sending more
            rows than its row holds, or ``input_split_sizes[r][j] !=
            output_split_sizes[j][r]`` (torch would hang or fail there).

    Example (4 devices; rank r holds 10r .. 10r+3 and sends r + 1 rows to rank 0)::

        >>> x = dist.per_rank(lambda r: np.arange(4.0) + 10 * r, dist.new_group([0, 1, 2, 3]))
        >>> ins = [[r + 1, 0, 0, 0] for r in range(4)]
        >>> outs = [[1, 2, 3, 4], [0] * 4, [0] * 4, [0] * 4]
        >>> y = dist.all_to_all_single(x, outs, ins, group=dist.new_group([0, 1, 2, 3]))
        >>> dist.to_ranks(y)[0]
        array([ 0., 10., 11., 20., 21., 22., 30., 31., 32., 33.], dtype=float32)
    """
    api = "dist.all_to_all_single"
    group = resolve_group(api, group)
    width = _width(api, x, group)
    if output_split_sizes is None and input_split_sizes is None:
        if width % group.size:
            raise ValueError(
                f"{api}: without split sizes each rank's input is split evenly, but "
                f"x's rows have width {width}, not divisible by the group size "
                f"{group.size}. Pass input_split_sizes and output_split_sizes."
            )
        return all_to_all(x, group, async_op, tiled=True)
    ins, outs = _split_tables(api, input_split_sizes, output_split_sizes, group, width)
    out_width = max(sum(row) for row in outs)
    out = _watched(api, _a2a_program(group, out_width)(x, _sizes(group, ins)), x)
    return Work(out) if async_op else out


@functools.lru_cache(maxsize=256)
def _gather_program(group: Group, sizes: tuple[int, ...], dst: int | None):
    spec = P(group.mesh_axes)

    def body(x):
        local = jax.tree_util.tree_map(lambda a: a[0], x)
        size = jnp.asarray(sizes, jnp.int32)[primitives.rank(group.axis_name)]
        if dst is None:
            padded, _ = primitives.all_gather_uneven(local, group.axis_name, size)
        else:
            padded, _ = primitives.gather_uneven(local, group.axis_name, size, dst)
        return [
            jax.tree_util.tree_map(lambda a, j=j: a[j, : sizes[j]][None], padded)
            for j in range(len(sizes))
        ]

    return Scheduled(
        jax.jit(
            jax.shard_map(body, mesh=group.mesh, in_specs=spec, out_specs=[spec] * len(sizes)),
        )
    )


def _gather_sizes(api: str, sizes: Any, group: Group, width: int) -> tuple[int, ...]:
    """One size per row; the same for a group rank in every subgroup (static shapes)."""
    rows = len(group.ranks)
    if not is_list(sizes, rows):
        raise ValueError(
            f"{api}: sizes must be a list of {rows} ints, one per rank (its "
            f"tensor's length along the first axis); got {sizes!r}."
        )
    sizes = [check_static_int(api, f"sizes[{r}]", s) for r, s in enumerate(sizes)]
    for r, s in enumerate(sizes):
        if not 0 <= s <= width:
            raise ValueError(
                f"{api}: sizes[{r}]={s} is outside 0..{width}, the width of x's "
                f"rows. Pad every rank's tensor to the longest (width >= "
                f"{max(sizes)})."
            )
    subs = _subgroup_rows(group)
    by_rank = tuple(sizes[row] for row in subs[0])
    for sub in subs[1:]:
        got = tuple(sizes[row] for row in sub)
        if got != by_rank:
            raise ValueError(
                f"{api}: the subgroups of {group!r} would gather tensors of "
                f"different sizes ({list(by_rank)} and {list(got)} per group "
                f"rank), which one program cannot return. Call it on each subgroup "
                f"(dist.new_group) instead."
            )
    return by_rank


def all_gather_uneven(
    x: PyTree,
    sizes: Sequence[int],
    group: Group | None = None,
    async_op: bool = False,
) -> list[PyTree] | Work:
    """Every rank gets the list of every rank's tensor, whose lengths differ per rank.

    ``torch.distributed.all_gather(tensor_list, tensor)`` with tensors of different sizes
    per rank (NCCL supports it): rank r's tensor is ``x[r, :sizes[r]]``, its row padded to a
    common width. The result is torch's ``tensor_list`` as a list of n per-rank arrays:
    ``result[j]`` has shape ``(n, sizes[j], ...)`` and its row r is what torch's rank r holds
    in ``tensor_list[j]`` (rank j's tensor, on every rank). Equivalent to::

        def all_gather_uneven(x, sizes):
            return [per_rank([x[j, :sizes[j]]] * n) for j in range(n)]

    Lowering: :func:`jaxcoll.primitives.all_gather_uneven` (one ``lax.all_gather`` of the
    padded rows and one of the sizes), then a static slice per rank. Any dtype, pytrees.

    Args:
        x: a per-rank array ``(n, width, ...)`` (or pytree of them) for ``group``.
        sizes: one int per row of ``x``: the length of that rank's tensor (0..width). For a
            partition, a group rank must have the same size in every subgroup.
        group: the group; the world if None.
        async_op: return a :class:`~jaxcoll.distributed.Work` holding the list.

    Returns:
        A list of n per-rank arrays (or a Work).

    Note:
        ``dist.all_gather`` needs one shape on every rank, as :func:`dist.per_rank` does; this
        function takes the padding and the sizes explicitly and returns exactly torch's list.

    Example (8 devices; rank r's tensor has r rows)::

        >>> x = dist.per_rank(lambda r: np.arange(7.0) * (np.arange(7) < r))
        >>> out = dist.all_gather_uneven(x, sizes=list(range(8)))
        >>> [o.shape for o in out][:3], dist.to_ranks(out[3])[5]
        ([(8, 0), (8, 1), (8, 2)], array([0., 1., 2.], dtype=float32))
    """
    api = "dist.all_gather_uneven"
    group = resolve_group(api, group)
    by_rank = _gather_sizes(api, sizes, group, _width(api, x, group))
    out = _watched(api, _gather_program(group, by_rank, None)(x), x)
    return Work(out) if async_op else out


def gather_uneven(
    x: PyTree,
    sizes: Sequence[int],
    dst: int | None = None,
    group: Group | None = None,
    async_op: bool = False,
    *,
    group_dst: int | None = None,
) -> list[PyTree] | Work:
    """Rank ``dst`` gets the list of every rank's tensor (lengths differ); other rows are zeros.

    ``torch.distributed.gather(tensor, gather_list, dst, group, async_op, group_dst)`` with
    tensors of different sizes per rank. As :func:`all_gather_uneven`, but only ``dst``'s row
    of each ``result[j]`` holds rank j's tensor; the other rows are zeros (SPMD: one shape per
    rank, where torch gives non-destination ranks nothing). ``dst`` is a GLOBAL rank,
    ``group_dst`` a rank within the group; pass at most one: with neither, the destination is
    global rank 0, as in torch. Lowering: :func:`jaxcoll.primitives.gather_uneven`.

    Example (8 devices)::

        >>> x = dist.per_rank(lambda r: np.full(4, r, np.float32))
        >>> out = dist.gather_uneven(x, sizes=[1, 2, 3, 4, 1, 2, 3, 4], dst=2)
        >>> dist.to_ranks(out[3])[2], dist.to_ranks(out[3])[0]
        (array([3., 3., 3., 3.], dtype=float32), array([0., 0., 0., 0.], dtype=float32))
    """
    api = "dist.gather_uneven"
    group = resolve_group(api, group)
    dst = group_root(api, group, dst, group_dst, "dst", default=0)
    by_rank = _gather_sizes(api, sizes, group, _width(api, x, group))
    out = _watched(api, _gather_program(group, by_rank, dst)(x), x)
    return Work(out) if async_op else out


@functools.lru_cache(maxsize=256)
def _reduce_scatter_program(group: Group, sizes: tuple[int, ...], op: ReduceOp):
    api = "dist.reduce_scatter_uneven"
    spec = P(group.mesh_axes)

    def body(x):
        for leaf in jax.tree_util.tree_leaves(x):  # checked when a new dtype is traced
            check_op_dtype(api, op, leaf.dtype)
        local = jax.tree_util.tree_map(lambda a: a[0], x)
        out, _ = primitives.reduce_scatter_uneven(local, group.axis_name, sizes, op)
        return jax.tree_util.tree_map(lambda a: a[None], out)

    return Scheduled(
        jax.jit(
            jax.shard_map(body, mesh=group.mesh, in_specs=spec, out_specs=spec),
        )
    )


def reduce_scatter_uneven(
    x: PyTree,
    sizes: Sequence[int],
    op: ReduceOp | str = ReduceOp.SUM,
    group: Group | None = None,
    async_op: bool = False,
) -> PyTree | Work:
    """Rank r gets part r of ``op`` over all ranks' inputs, where part r has ``sizes[r]`` rows.

    ``torch.distributed.reduce_scatter(output, input_list, op, group, async_op)`` with parts of
    different sizes per rank (rank r's ``output`` has ``input_list[r]``'s size, the same on
    every rank): row r of ``x`` (shape ``(n, sum(sizes), ...)``) is rank r's ``input_list``
    concatenated. Row r of the result holds torch's rank r output, then zero padding up to
    ``max(sizes)``. Equivalent to::

        def reduce_scatter_uneven(x, sizes, op):
            total = functools.reduce(op, to_ranks(x))        # AVG: sum / n
            starts = np.cumsum([0, *sizes])
            rows = [pad(total[starts[r]:starts[r + 1]], max(sizes)) for r in range(n)]
            return per_rank(rows, group)

    Lowering: :func:`jaxcoll.primitives.reduce_scatter_uneven` (one ``reduce_scatter`` of the
    parts padded to ``max(sizes)`` rows, or, when one part is much longer than the others, one
    ``all_reduce`` and a slice: whichever moves fewer bytes). Every op/dtype pair
    :func:`reduce_scatter` allows; pytrees whose leaves share the width.

    Args:
        x: a per-rank array ``(n, sum(sizes), ...)`` (or pytree of them) for ``group``.
        sizes: one int per group rank: the rows of its part (torch's ``input_list[r]``
            length). For a partition (``new_subgroups``, ``hierarchy``) every subgroup splits
            the same way.
        op: a :class:`~jaxcoll.ReduceOp` or its name.
        group: the group; the world if None.
        async_op: return a :class:`~jaxcoll.distributed.Work`.

    Returns:
        A per-rank array ``(n, max(sizes), ...)``: torch's rank r output is
        ``y[r, :sizes[r]]`` (for a partition, ``sizes`` of row r's group rank).

    Raises:
        ValueError: ``sizes`` of the wrong length or with a negative entry, or not summing to
            the width of ``x``'s rows.
        TypeError: ``op`` not defined for a dtype of ``x``.

    Example (4 devices; parts of 1, 2, 3 and 2 rows; rank r holds 0..7 times r + 1)::

        >>> g = dist.new_group([0, 1, 2, 3])
        >>> x = dist.per_rank(lambda r: np.arange(8.0) * (r + 1), g)
        >>> y = dist.reduce_scatter_uneven(x, [1, 2, 3, 2], group=g)
        >>> dist.to_ranks(y)[2]
        array([30., 40., 50.], dtype=float32)
    """
    api = "dist.reduce_scatter_uneven"
    group = resolve_group(api, group)
    width = _width(api, x, group)
    sizes = check_sizes(api, sizes, group.size, width, f"x's rows have width {width}")
    op = op if isinstance(op, ReduceOp) else coerce_op(api, op)
    out = _watched(api, _reduce_scatter_program(group, sizes, op)(x), x)
    return Work(out) if async_op else out
