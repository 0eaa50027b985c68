"""Uneven collectives: a ragged all_to_all (MoE token dispatch), an uneven all_gather/gather
and an uneven reduce_scatter.

Under SPMD every rank's array has one static shape, so "a different number of rows per rank"
is written the way MoE code writes it: a static-capacity buffer plus the sizes (traced, or,
where they set the result's shape, static).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import lowering, ragged_lowering
from .._core.axis import Axis, resolve
from .._core.checks import as_array_leaves, check_rank, check_sizes, check_static_int
from .._core.ops import ReduceOp, check_op_dtype, coerce_op
from .._core.protocol import dispatch
from .._core.typing import AxisName, PyTree
from ._all_reduce import all_reduce
from ._reduce_scatter import reduce_scatter


def _leading(api: str, leaves: list[jax.Array], what: str) -> int:
    """Every leaf's leading axis is the ragged one; all must have the same length."""
    for leaf in leaves:
        if leaf.ndim == 0:
            raise ValueError(
                f"{api}: x holds a scalar, but every leaf needs a leading axis of "
                f"{what} rows. Reshape it to (rows, ...)."
            )
    m = leaves[0].shape[0]
    bad = [leaf.shape for leaf in leaves if leaf.shape[0] != m]
    if bad:
        raise ValueError(
            f"{api}: the leaves of x have leading sizes {m} and {bad[0][0]}; every "
            f"leaf must hold the same number of {what} rows."
        )
    return m


def _int_array(api: str, argname: str, value: Any, shape: tuple[int, ...]) -> jax.Array:
    """An integer array (traced or not) of exactly ``shape``."""
    try:
        v = jnp.asarray(value)
    except TypeError:
        raise TypeError(
            f"{api}: {argname} must be an integer array, got {value!r} of type "
            f"{type(value).__name__} instead."
        ) from None
    if not jnp.issubdtype(v.dtype, jnp.integer):
        raise TypeError(
            f"{api}: {argname} must hold integers, got dtype {v.dtype} instead. "
            f"Cast it with .astype(jnp.int32)."
        )
    if v.shape != shape:
        raise ValueError(
            f"{api}: {argname} has shape {v.shape}, but it must have shape "
            f"{shape} ({'one entry per rank' if shape else 'a scalar'})."
        )
    return v.astype(jnp.int32)


@dispatch
def ragged_all_to_all(
    x: PyTree,
    axis_name: AxisName,
    send_sizes: jax.typing.ArrayLike,
    *,
    out_size: int | None = None,
) -> tuple[PyTree, jax.Array]:
    """Each rank sends ``send_sizes[j]`` rows to rank j; each receives them packed in rank order.

    The SPMD form of ``torch.distributed.all_to_all_single(out, x, output_split_sizes,
    input_split_sizes)``, as MoE token dispatch uses it: ``x`` is a static-capacity buffer whose
    leading rows are sorted by destination, ``send_sizes`` (traced) says how many go where.
    Equivalent to::

        def ragged_all_to_all(x, axis_name, send_sizes, out_size=None):
            r, n = rank(axis_name), world_size(axis_name)
            parts = []
            for j in range(n):                              # senders, in rank order
                sizes_j, x_j = send_sizes_of_rank(j), x_of_rank(j)
                start = sum(sizes_j[:r])
                parts.append(x_j[start:start + sizes_j[r]])
            recv = jnp.concatenate(parts)[:out_size]        # rows that do not fit are dropped
            out = zeros((out_size, *x.shape[1:])).at[:len(recv)].set(recv)
            recv_sizes = [len(p) for p in parts]            # clipped to what fits in out
            return out, recv_sizes

    Lowering: two small int32 ``all_to_all``s settle the sizes and offsets; then on GPU
    (cuda, rocm) one ``lax.ragged_all_to_all`` (HLO ragged-all-to-all) moves exactly the rows;
    where XLA has none (CPU, and under ``jax.vmap``) a padded ``lax.all_to_all`` of ``n``
    fixed-capacity chunks of ``min(x.shape[0], out_size)`` rows plus one scatter places them
    (correct for any sizes, but it moves ``n * capacity`` rows per rank). Any dtype, pytrees
    (every leaf shares the sizes); ``jax.grad`` with respect to ``x`` is the ragged all_to_all
    back to where each row came from.

    Args:
        x: an array or pytree of arrays, each leaf ``(m, *s)``; rows ``[sum(send_sizes[:j]),
            sum(send_sizes[:j+1]))`` go to rank j. Rows past ``sum(send_sizes)`` are not sent.
        axis_name: mesh axis name or tuple of names.
        send_sizes: int array of shape ``(n,)``, traced or not. Negative entries count as 0;
            rows past ``m`` are not sent (the sizes are clipped to the buffer).
        out_size: static row count of the result (the receive capacity); default ``m``.

    Returns:
        ``(out, recv_sizes)``: ``out`` like ``x`` with ``out_size`` rows, the received rows
        packed in sender order then zeros; ``recv_sizes`` int32 ``(n,)``, how many rows of
        ``out`` came from each rank.

    Note:
        torch sizes the output to fit exactly; under SPMD the capacity is static, so rows that
        do not fit are dropped (as MoE capacity factors drop tokens) and ``recv_sizes`` counts
        what was kept. ``lax.ragged_all_to_all`` has another signature (explicit offsets and an
        output buffer): this function computes those from ``send_sizes``.

    Example (2 devices)::

        >>> def f(x, sizes):   # rank 0 sends 1 row to itself, 2 to rank 1; rank 1: 1 and 1
        ...     out, recv = ragged_all_to_all(x[0], "x", sizes[0])
        ...     return out[None], recv[None]
        >>> g = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> g(jnp.array([[1., 2., 2.], [3., 4., 0.]]), jnp.array([[1, 2], [1, 1]]))
        (Array([[1., 3., 0.], [2., 2., 4.]], dtype=float32), Array([[1, 1], [2, 1]], ...))
    """
    out, recv, _ = ragged_exchange(x, axis_name, send_sizes, out_size=out_size)
    return out, recv


def ragged_exchange(
    x: PyTree,
    axis_name: AxisName,
    send_sizes: jax.typing.ArrayLike,
    *,
    out_size: int | None = None,
    rows: int | None = None,
) -> tuple[PyTree, jax.Array, tuple[jax.Array, ...]]:
    """:func:`ragged_all_to_all`, with the exchange's plan for :func:`ragged_return` (which
    sends the rows back with no new exchange of sizes): ``(out, recv_sizes, plan)``.
    ``rows``: the most rows any rank sends to any one rank, when the caller knows it (an MoE
    capacity): the CPU lowering then moves ``n * rows`` rows per rank."""
    api = "ragged_all_to_all"
    ax = resolve(api, axis_name)
    leaves, treedef = as_array_leaves(api, x)
    m = _leading(api, leaves, "buffer")
    cap = m if out_size is None else check_static_int(api, "out_size", out_size)
    if cap < 0:
        raise ValueError(
            f"{api}: out_size={cap} is negative; pass the number of rows each "
            f"rank can receive (>= 0)."
        )
    sizes = _int_array(api, "send_sizes", send_sizes, (ax.size,))
    plan = ragged_lowering.ragged_plan(sizes, ax, m, cap)
    out = ragged_lowering.ragged_all_to_all(leaves, ax, plan, cap, rows)
    return jax.tree_util.tree_unflatten(treedef, out), plan[3], plan


def ragged_return(
    y: PyTree, axis_name: AxisName, plan: tuple, *, out_size: int, rows: int | None = None
) -> PyTree:
    """Send the rows a :func:`ragged_exchange` delivered (``y``, in the order they arrived)
    back to where each came from, into ``out_size`` rows (zeros where nothing came back), by
    its plan: one ragged all-to-all, no exchange of sizes (MoE's combine after its
    dispatch)."""
    ax = resolve("ragged_return", axis_name)
    leaves, treedef = as_array_leaves("ragged_return", y)
    back = ragged_lowering.ragged_all_to_all(
        leaves, ax, ragged_lowering.reverse(plan), out_size, rows
    )
    return jax.tree_util.tree_unflatten(treedef, back)


@dispatch
def all_gather_uneven(
    x: PyTree, axis_name: AxisName, size: jax.typing.ArrayLike
) -> tuple[PyTree, jax.Array]:
    """Every rank gets every rank's first ``size`` rows: a padded buffer plus the sizes.

    The SPMD form of ``torch.distributed.all_gather(tensor_list, tensor)`` when the tensors
    differ in size per rank (NCCL allows it). Each rank passes its rows padded to one capacity
    ``cap`` and how many are real. Equivalent to::

        def all_gather_uneven(x, axis_name, size):
            n = world_size(axis_name)
            sizes = jnp.array([clip(size_of_rank(j), 0, cap) for j in range(n)])
            padded = jnp.stack([where(arange(cap) < sizes[j], x_of_rank(j), 0)
                                for j in range(n)])
            return padded, sizes         # rank j's tensor is padded[j, :sizes[j]]

    Lowering: one ``lax.all_gather`` of the zero-padded buffer and one of the size, both
    typed invariant (the same on every rank). Any dtype, pytrees (every leaf has ``cap`` rows
    and shares ``size``); differentiable in ``x`` (padding rows get zero gradient).

    Args:
        x: an array or pytree of arrays, each leaf ``(cap, *s)``.
        axis_name: mesh axis name or tuple of names.
        size: this rank's number of real rows, an int scalar (traced or not), clipped to
            ``0..cap``.

    Returns:
        ``(padded, sizes)``: ``padded`` like ``x`` with a new leading rank axis ``(n, cap,
        *s)``, rows past each rank's size zeroed; ``sizes`` int32 ``(n,)``.

    Example (4 devices; rank r holds r + 1 real rows of 4)::

        >>> f = jax.shard_map(lambda x: all_gather_uneven(x, "x", rank("x") + 1)[1][None],
        ...                   mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.ones((16, 2)))[0]
        Array([1, 2, 3, 4], dtype=int32)
    """
    api = "all_gather_uneven"
    ax = resolve(api, axis_name)
    leaves, treedef = as_array_leaves(api, x)
    cap = _leading(api, leaves, "padded")
    size = jnp.clip(_int_array(api, "size", size, ()), 0, cap)
    out = [lowering.all_gather_uneven(leaf, size, ax) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, out), lowering.all_gather(size, ax)


@dispatch
def gather_uneven(
    x: PyTree, axis_name: AxisName, size: jax.typing.ArrayLike, dst: int
) -> tuple[PyTree, jax.Array]:
    """Rank ``dst`` gets :func:`all_gather_uneven`'s result; every other rank gets zeros.

    The SPMD form of ``torch.distributed.gather(tensor, gather_list, dst)`` with tensors of
    different sizes per rank. Equivalent to::

        def gather_uneven(x, axis_name, size, dst):
            padded, sizes = all_gather_uneven(x, axis_name, size)
            if rank(axis_name) == dst:
                return padded, sizes
            return jnp.zeros_like(padded), jnp.zeros_like(sizes)

    Lowering: :func:`all_gather_uneven` then a select on the rank (lax has no rooted gather).

    Args:
        x: as in :func:`all_gather_uneven`.
        axis_name: mesh axis name or tuple of names.
        size: as in :func:`all_gather_uneven`.
        dst: the destination rank, a static int in ``0..world_size-1``.

    Returns:
        ``(padded, sizes)`` on ``dst``; zeros of the same shapes elsewhere.

    Note:
        Under SPMD every rank's result has one shape: non-destination ranks get zeros where
        torch gives them nothing.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda x: gather_uneven(x, "x", 2, dst=1)[1][None], mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.ones((16, 2)))[:, 0]
        Array([0, 2, 0, 0], dtype=int32)
    """
    api = "gather_uneven"
    ax = resolve(api, axis_name)
    dst = check_rank(api, "dst", dst, ax.size)
    padded, sizes = all_gather_uneven(x, ax.name, size)
    here = ax.rank() == dst
    return (
        jax.tree_util.tree_map(lambda a: jnp.where(here, a, jnp.zeros((), a.dtype)), padded),
        jnp.where(here, sizes, np.int32(0)),
    )


@dispatch
def reduce_scatter_uneven(
    x: PyTree,
    axis_name: AxisName,
    sizes: Sequence[int],
    op: ReduceOp | str = ReduceOp.SUM,
) -> tuple[PyTree, jax.Array]:
    """Rank r gets part r (``sizes[r]`` rows) of ``op`` over every rank's ``x``, padded.

    The SPMD form of ``torch.distributed.reduce_scatter(output, input_list, op)`` when the
    parts differ in size (rank r's ``output`` has ``input_list[r]``'s size; NCCL supports it,
    torch's test is ``test_reduce_scatter_v_cuda``). Every rank passes
    its ``input_list`` concatenated along the first axis, ``sum(sizes)`` rows, and the same
    static ``sizes``. Equivalent to::

        def reduce_scatter_uneven(x, axis_name, sizes, op):
            r, cap = rank(axis_name), max(sizes)
            total = all_reduce(x, axis_name, op)
            start = sum(sizes[:r])
            part = total[start:start + sizes[r]]            # torch's output on rank r
            out = zeros((cap, *x.shape[1:])).at[:sizes[r]].set(part)
            return out, sizes[r]

    Lowering: whichever moves fewer bytes. When ``n * max(sizes) <= 2 * sum(sizes)`` (sizes
    roughly even): one :func:`reduce_scatter` (``lax.psum_scatter`` for SUM/AVG, an
    ``all_to_all`` + local fold for the other ops) of the n parts, each widened to
    ``max(sizes)`` rows. Otherwise (one part much longer than the rest): one
    :func:`all_reduce` of the ``sum(sizes)`` rows, then a slice at this rank's offset. Every op
    and dtype :func:`reduce_scatter` allows (float16 SUM/AVG accumulate in float32), pytrees
    (every leaf has ``sum(sizes)`` rows); differentiable for SUM and AVG.

    Args:
        x: an array or pytree of arrays, each leaf ``(sum(sizes), *s)``: the n parts, rank j's
            part at rows ``sum(sizes[:j]) .. sum(sizes[:j+1]) - 1``. The same layout on every
            rank.
        axis_name: mesh axis name or tuple of names.
        sizes: n static non-negative ints, ``sizes[r]`` the rows of rank r's part (they set
            the result's shape, so they cannot be traced).
        op: a :class:`~jaxcoll.ReduceOp` or its name (dtype rules as :func:`all_reduce`).

    Returns:
        ``(out, size)``: ``out`` like ``x`` with ``max(sizes)`` rows, this rank's reduced part
        then zeros; ``size`` int32, ``sizes[r]`` (torch's output is ``out[:size]``).

    Note:
        torch sizes each rank's output exactly; under SPMD every rank's result has one shape,
        so it is padded to the longest part, as :func:`all_gather_uneven` pads.

    Example (4 devices; parts of 1, 2, 3 and 2 rows, every rank holds 0..7)::

        >>> f = jax.shard_map(
        ...     lambda v: reduce_scatter_uneven(v, "x", [1, 2, 3, 2])[0][None],
        ...     mesh=mesh, in_specs=P(), out_specs=P("x"))
        >>> f(jnp.arange(8.0))
        Array([[ 0.,  0.,  0.], [ 4.,  8.,  0.], [12., 16., 20.], [24., 28.,  0.]],
              dtype=float32)
    """
    api = "reduce_scatter_uneven"
    op = coerce_op(api, op)
    ax = resolve(api, axis_name)
    leaves, treedef = as_array_leaves(api, x)
    m = _leading(api, leaves, "input")
    sizes = check_sizes(api, sizes, ax.size, m, f"x has {m} rows")
    for leaf in leaves:
        check_op_dtype(api, op, leaf.dtype)
    out, size = _reduce_scatter_parts(leaves, ax, op, sizes)
    return jax.tree_util.tree_unflatten(treedef, out), size


def _reduce_scatter_parts(
    leaves: list[jax.Array], ax: Axis, op: ReduceOp, sizes: tuple[int, ...]
) -> tuple[list[jax.Array], jax.Array]:
    """Part ``rank`` of ``op`` over the ranks' leaves (checked), padded to ``max(sizes)`` rows:
    by a reduce-scatter of the padded parts, or an all-reduce when that moves fewer bytes."""
    m, n, cap = sum(sizes), ax.size, max(sizes)
    starts = np.cumsum((0, *sizes[:-1])).tolist()
    r = ax.rank()
    if n * cap <= 2 * m:  # the n padded parts move no more than an all-reduce of m rows would
        parts = [_windows(leaf, starts, cap) for leaf in leaves]
        out = reduce_scatter(parts, ax.name, op, tiled=True)
    else:
        total = all_reduce(leaves, ax.name, op)
        start = jnp.asarray(starts, jnp.int32)[r]
        out = [jax.lax.dynamic_slice_in_dim(_padded(t, m + cap), start, cap) for t in total]
    size = jnp.asarray(sizes, jnp.int32)[r]
    return [_zero_from(o, size) for o in out], size


def _windows(a: jax.Array, starts: list[int], rows: int) -> jax.Array:
    """The ``rows`` rows of ``a`` from each of ``starts``, concatenated: a window longer than
    its part runs on into the next part's rows, or zeros past ``a``'s end (the caller zeroes
    them after the reduction)."""
    # Not each part padded alone: jax 0.11.2's eager shard_map segfaults padding an empty part.
    a = _padded(a, a.shape[0] + rows)
    return jnp.concatenate([a[s : s + rows] for s in starts])


def _padded(a: jax.Array, rows: int) -> jax.Array:
    """``a`` with zero rows appended up to ``rows``."""
    return jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _zero_from(a: jax.Array, size: jax.Array) -> jax.Array:
    """``a`` with its rows from ``size`` on set to zero."""
    keep = (jnp.arange(a.shape[0]) < size).reshape((a.shape[0],) + (1,) * (a.ndim - 1))
    return jnp.where(keep, a, jnp.zeros((), a.dtype))
