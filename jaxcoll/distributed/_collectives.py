"""The collectives on per-rank arrays: each one a cached, jitted shard_map over the group.

Every function here takes per-rank arrays (see :func:`~jaxcoll.distributed.per_rank`) and returns
new ones: row r of the result is rank r's result. Each call runs a program built once per
(op, group, options) by :func:`_program`: ``jax.jit(jax.shard_map(body, mesh=group.mesh))``
where ``body`` calls the matching :mod:`jaxcoll.primitives` function on the group's mesh axis,
so the lowerings (and their docstrings) are the primitives'. ``jax.jit`` then caches the
compiled program per input shape, dtype and pytree structure: a repeated call neither retraces
nor recompiles, it only dispatches.

Options that name a tensor dimension (``dim``, ``scatter_dimension``, ``split_dim``,
``concat_dim``) count the dimensions of one rank's value, not the leading rank dimension.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from .. import primitives
from .._core.checks import check_pairs
from .._core.ops import ReduceOp, check_op_dtype, coerce_op
from .._core.scheduled import Scheduled
from .._core.typing import PyTree
from .._watch import detect, process, watchdog
from ..groups import Group
from . import _inflight
from ._group import group_root, resolve_group
from ._per_rank import check_per_rank, per_rank
from ._work import Work

TRACES: collections.Counter[str] = collections.Counter()
"""How many times each op's program body was traced (a repeated call must not add one)."""


@functools.lru_cache(maxsize=512)
def _program(api: str, name: str, group: Group, options: tuple[tuple[str, Any], ...]):
    fn = getattr(primitives, name)
    kwargs = dict(options)
    spec = P(group.mesh_axes)

    def body(x):
        TRACES[name] += 1
        if "op" in kwargs:  # checked when a new dtype is traced, not on every call
            for leaf in jax.tree_util.tree_leaves(x):
                check_op_dtype(api, kwargs["op"], leaf.dtype)
        local = jax.tree_util.tree_map(lambda a: a[0], x)  # this rank's value
        out = fn(local, group.axis_name, **kwargs)
        return jax.tree_util.tree_map(lambda a: a[None], out)

    return Scheduled(
        jax.jit(
            jax.shard_map(body, mesh=group.mesh, in_specs=spec, out_specs=spec),
        )
    )


def _run(api: str, name: str, x: PyTree, group: Group, async_op: bool, **options: Any):
    check_per_rank(api, x, group)
    settings = tuple(sorted(options.items()))
    program = _program(api, name, group, settings)
    now = process.settings
    if now.detail:  # JAXCOLL_DEBUG=detail: compare with the other processes at first use
        _agree_first_use(api, name, program, x, group, options)
    if now.on:  # watchdog and flight recorder, from before the dispatch (never waiting)
        out = watchdog.run(program, x, api, options_text(settings))
    else:
        out = program(x)
    _inflight.admit(out)  # past the bound, waits for the oldest call in flight
    return Work(out) if async_op else out


@functools.lru_cache(maxsize=512)
def options_text(settings: tuple[tuple[str, Any], ...]) -> str:
    """``op=SUM src=0``: an op's options as the flight recorder keeps them."""
    return " ".join(f"{k}={v.name if isinstance(v, ReduceOp) else v}" for k, v in settings)


_AGREED: set[Any] = set()


def _agree_first_use(
    api: str, name: str, program: Any, x: PyTree, group: Group, options: dict[str, Any]
) -> None:
    """The first call of ``program`` per input shapes: check every process of ``group`` runs
    the same one (op, group, shapes, dtypes, options, lowered program)."""
    shape = getattr(x, "shape", None)
    if shape is not None:  # one array, the common case: no flattening
        key = (program, shape, x.dtype)
    else:
        leaves, treedef = jax.tree_util.tree_flatten(x)
        key = (
            program,
            treedef,
            tuple((getattr(v, "shape", None), getattr(v, "dtype", type(v))) for v in leaves),
        )
    if key in _AGREED:
        return
    devices = jax.devices()
    procs = tuple(sorted({devices[r].process_index for r in group.ranks}))
    if len(procs) > 1:
        fields = {
            "call": name,
            "args": detect.describe_args(x),
            "group": f"ranks {list(group.ranks)}",
        }
        if shape is None:  # a pytree: its structure must match too
            fields["tree"] = str(jax.tree_util.tree_structure(x))
        for k, v in sorted(options.items()):
            fields[k] = v.name if isinstance(v, ReduceOp) else str(v)
        fields["program"] = detect.program_hash(program.lower(x).as_text())
        detect.agree(api, fields, procs)
    _AGREED.add(key)


@functools.lru_cache(maxsize=256)
def _checked_pairs(api: str, pairs: Any, n: int) -> tuple[tuple[int, int], ...]:
    return check_pairs(api, pairs, n)  # cached: a repeated exchange is checked once


def _op(api: str, x: PyTree, op: Any) -> ReduceOp:
    """``op`` as a ReduceOp; whether it suits ``x``'s dtypes is checked when the program for
    them is traced (:func:`_program`), so a repeated call does no checking."""
    return op if isinstance(op, ReduceOp) else coerce_op(api, op)


def all_reduce(
    x: PyTree,
    op: ReduceOp | str = ReduceOp.SUM,
    group: Group | None = None,
    async_op: bool = False,
) -> PyTree | Work:
    """Every rank of ``group`` gets ``op`` over all ranks' values.

    ``torch.distributed.all_reduce(tensor, op, group, async_op)``. Equivalent to::

        total = functools.reduce(op, to_ranks(x))            # AVG: sum / n
        return per_rank([total] * n, group)

    Lowering: :func:`jaxcoll.primitives.all_reduce` on the group's mesh axis (``psum`` /
    ``pmean`` / ``pmin`` / ``pmax``; PRODUCT and bitwise ops by all_to_all + fold +
    all_gather). Every op/dtype pair the primitive allows.

    Args:
        x: a per-rank array (or pytree of them) for ``group``.
        op: a :class:`~jaxcoll.ReduceOp` or its name.
        group: the group; the world if None.
        async_op: return a :class:`Work` instead of the result.

    Returns:
        A new per-rank array (or a :class:`Work` holding it).

    Note:
        torch reduces in place and returns None (or a Work); here ``x`` is unchanged and the
        result is returned. Without ``async_op`` the call still returns before the device work
        finishes (JAX dispatch is asynchronous); reading the result waits for it.

    Example (8 devices)::

        >>> y = dist.all_reduce(dist.per_rank(np.arange(8.0)), op=dist.ReduceOp.MAX)
        >>> dist.to_ranks(y)[0]
        array(7., dtype=float32)
    """
    api = "dist.all_reduce"
    group = resolve_group(api, group)
    return _run(api, "all_reduce", x, group, async_op, op=_op(api, x, op))


def reduce(
    x: PyTree,
    dst: int | None = None,
    op: ReduceOp | str = ReduceOp.SUM,
    group: Group | None = None,
    async_op: bool = False,
    *,
    group_dst: int | None = None,
) -> PyTree | Work:
    """Rank ``dst`` gets ``op`` over all ranks' values of ``group``; the others keep theirs.

    ``torch.distributed.reduce(tensor, dst, op, group, async_op, group_dst)``: ``dst`` is a
    GLOBAL rank (a member of the group), ``group_dst`` a rank within the group; pass one.
    Lowering: :func:`jaxcoll.primitives.reduce`.

    Example (8 devices)::

        >>> y = dist.reduce(dist.per_rank(np.arange(8.0)), dst=2)
        >>> [float(v) for v in dist.to_ranks(y)[:4]]
        [0.0, 1.0, 28.0, 3.0]
    """
    api = "dist.reduce"
    group = resolve_group(api, group)
    dst = group_root(api, group, dst, group_dst, "dst")
    return _run(api, "reduce", x, group, async_op, dst=dst, op=_op(api, x, op))


def broadcast(
    x: PyTree,
    src: int | None = None,
    group: Group | None = None,
    async_op: bool = False,
    *,
    group_src: int | None = None,
) -> PyTree | Work:
    """Every rank of ``group`` gets rank ``src``'s value.

    ``torch.distributed.broadcast(tensor, src, group, async_op, group_src)``: ``src`` is a
    GLOBAL rank (a member of the group), ``group_src`` a rank within the group; pass one.
    Lowering: :func:`jaxcoll.primitives.broadcast` (NCCL broadcast on GPU, a ppermute tree on
    CPU). Bit-exact, any dtype.

    Example (8 devices)::

        >>> y = dist.broadcast(dist.per_rank(np.arange(8.0)), src=3)
        >>> dist.to_ranks(y)[0]
        array(3., dtype=float32)
    """
    api = "dist.broadcast"
    group = resolve_group(api, group)
    src = group_root(api, group, src, group_src, "src")
    return _run(api, "broadcast", x, group, async_op, src=src)


def all_gather(
    x: PyTree,
    group: Group | None = None,
    async_op: bool = False,
    *,
    dim: int = 0,
    tiled: bool = False,
) -> PyTree | Work:
    """Every rank gets all ranks' values, stacked (or, ``tiled``, concatenated) in rank order.

    ``torch.distributed.all_gather(tensor_list, tensor)`` (``tiled=True``:
    ``all_gather_into_tensor``). Row r of the result has shape ``(n, *s)`` for rows of shape
    ``s``. Lowering: :func:`jaxcoll.primitives.all_gather` (one ``lax.all_gather``).

    Example (8 devices)::

        >>> y = dist.all_gather(dist.per_rank(np.arange(8.0)))
        >>> y.shape
        (8, 8)
    """
    api = "dist.all_gather"
    group = resolve_group(api, group)
    return _run(api, "all_gather", x, group, async_op, dim=dim, tiled=bool(tiled))


def gather(
    x: PyTree,
    dst: int | None = None,
    group: Group | None = None,
    async_op: bool = False,
    *,
    group_dst: int | None = None,
    dim: int = 0,
    tiled: bool = False,
) -> PyTree | Work:
    """Rank ``dst`` gets all ranks' values in group rank order; the other rows are zeros.

    ``torch.distributed.gather(tensor, gather_list, dst, group, async_op, group_dst)``: ``dst``
    a GLOBAL rank, ``group_dst`` a rank within the group; pass at most one. With neither, the
    destination is global rank 0, as in torch (a group without global rank 0 then needs one of
    them). Every row has the gathered shape (SPMD), so non-destination rows are zeros where
    torch gives them nothing. Lowering: :func:`jaxcoll.primitives.gather`.

    Example (8 devices)::

        >>> y = dist.gather(dist.per_rank(np.arange(8.0)))      # dst: global rank 0
        >>> dist.to_ranks(y)[0]
        array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)
    """
    api = "dist.gather"
    group = resolve_group(api, group)
    dst = group_root(api, group, dst, group_dst, "dst", default=0)
    return _run(api, "gather", x, group, async_op, dst=dst, dim=dim, tiled=bool(tiled))


def scatter(
    x: PyTree,
    src: int | None = None,
    group: Group | None = None,
    async_op: bool = False,
    *,
    group_src: int | None = None,
    dim: int = 0,
    tiled: bool = False,
) -> PyTree | Work:
    """Group rank r gets slice r of rank ``src``'s value; the other rows of ``x`` are not read.

    ``torch.distributed.scatter(tensor, scatter_list, src, group, async_op, group_src)``:
    ``src`` a GLOBAL rank, ``group_src`` a rank within the group; pass at most one. With
    neither, the source is global rank 0, as in torch (a group without global rank 0 then needs
    one of them). Each row of ``x`` holds the n slices stacked along ``dim`` (or, ``tiled``,
    a dimension n times longer). Only ``src``'s row matters; the others give the shape.
    Lowering: :func:`jaxcoll.primitives.scatter`.

    Example (8 devices)::

        >>> x = dist.per_rank(lambda r: np.arange(8.0) * (r == 0))
        >>> dist.to_ranks(dist.scatter(x))[5]                  # src: global rank 0
        array(5., dtype=float32)
    """
    api = "dist.scatter"
    group = resolve_group(api, group)
    src = group_root(api, group, src, group_src, "src", default=0)
    return _run(api, "scatter", x, group, async_op, src=src, dim=dim, tiled=bool(tiled))


def reduce_scatter(
    x: PyTree,
    op: ReduceOp | str = ReduceOp.SUM,
    group: Group | None = None,
    async_op: bool = False,
    *,
    scatter_dimension: int = 0,
    tiled: bool = False,
) -> PyTree | Work:
    """Rank r gets slice r (along ``scatter_dimension``) of ``op`` over all ranks' values.

    ``torch.distributed.reduce_scatter`` / ``reduce_scatter_tensor``. Lowering:
    :func:`jaxcoll.primitives.reduce_scatter` (``psum_scatter`` for SUM/AVG, all_to_all + fold
    for the other ops).

    Example (8 devices)::

        >>> x = dist.per_rank(lambda r: np.arange(8.0))
        >>> dist.to_ranks(dist.reduce_scatter(x))[3]
        array(24., dtype=float32)
    """
    api = "dist.reduce_scatter"
    group = resolve_group(api, group)
    return _run(
        api,
        "reduce_scatter",
        x,
        group,
        async_op,
        op=_op(api, x, op),
        scatter_dimension=scatter_dimension,
        tiled=bool(tiled),
    )


def all_to_all(
    x: PyTree,
    group: Group | None = None,
    async_op: bool = False,
    *,
    split_dim: int = 0,
    concat_dim: int = 0,
    tiled: bool = False,
) -> PyTree | Work:
    """Rank r gets slice r of every rank's value, in rank order.

    ``torch.distributed.all_to_all`` / ``all_to_all_single``. Lowering:
    :func:`jaxcoll.primitives.all_to_all` (one ``lax.all_to_all``).

    Example (8 devices)::

        >>> x = dist.per_rank(lambda r: np.arange(8.0) + 10 * r)
        >>> dist.to_ranks(dist.all_to_all(x))[1]
        array([ 1., 11., 21., 31., 41., 51., 61., 71.], dtype=float32)
    """
    api = "dist.all_to_all"
    group = resolve_group(api, group)
    return _run(
        api,
        "all_to_all",
        x,
        group,
        async_op,
        split_dim=split_dim,
        concat_dim=concat_dim,
        tiled=bool(tiled),
    )


def sendrecv(
    x: PyTree,
    pairs: Sequence[tuple[int, int]],
    group: Group | None = None,
    async_op: bool = False,
) -> PyTree | Work:
    """Each ``(src, dst)`` in ``pairs`` sends src's value to dst, all at once.

    Matched torch ``send``/``recv`` calls, or one ``batch_isend_irecv`` list. Ranks are group
    ranks; each rank sends at most once and receives at most once per call (cycles are fine).
    Non-receivers keep their value. Lowering: :func:`jaxcoll.primitives.sendrecv` (one
    ``lax.ppermute``).

    Example (8 devices)::

        >>> y = dist.sendrecv(dist.per_rank(np.arange(8.0)), [(0, 3), (3, 0)])
        >>> [float(v) for v in dist.to_ranks(y)[:4]]
        [3.0, 1.0, 2.0, 0.0]
    """
    api = "dist.sendrecv"
    group = resolve_group(api, group)
    pairs = _checked_pairs(
        api, tuple(map(tuple, pairs)) if isinstance(pairs, list) else pairs, group.size
    )
    return _run(api, "sendrecv", x, group, async_op, pairs=pairs)


def send(
    x: PyTree,
    dst: int | None = None,
    src: int | None = None,
    group: Group | None = None,
    *,
    group_dst: int | None = None,
    group_src: int | None = None,
) -> PyTree:
    """Rank ``src`` sends its value to rank ``dst``: ``sendrecv(x, [(src, dst)])``.

    torch's ``send(tensor, dst)`` on the sender plus ``recv(tensor, src)`` on the receiver,
    written once for both sides (SPMD), so ``send`` names both ranks. As in torch, ``dst`` and
    ``src`` are GLOBAL ranks; ``group_dst`` / ``group_src`` name ranks within ``group``.

    Example (8 devices)::

        >>> dist.to_ranks(dist.send(dist.per_rank(np.arange(8.0)), dst=5, src=0))[5]
        array(0., dtype=float32)
    """
    return _p2p("dist.send", x, group, False, dst, src, group_dst, group_src)


def recv(
    x: PyTree,
    src: int | None = None,
    dst: int | None = None,
    group: Group | None = None,
    *,
    group_src: int | None = None,
    group_dst: int | None = None,
) -> PyTree:
    """Rank ``dst`` receives rank ``src``'s value: the same exchange as :func:`send`."""
    return _p2p("dist.recv", x, group, False, dst, src, group_dst, group_src)


def isend(
    x: PyTree,
    dst: int | None = None,
    src: int | None = None,
    group: Group | None = None,
    *,
    group_dst: int | None = None,
    group_src: int | None = None,
) -> Work:
    """:func:`send` with ``async_op=True``: returns a :class:`Work`."""
    return _p2p("dist.isend", x, group, True, dst, src, group_dst, group_src)


def irecv(
    x: PyTree,
    src: int | None = None,
    dst: int | None = None,
    group: Group | None = None,
    *,
    group_src: int | None = None,
    group_dst: int | None = None,
) -> Work:
    """:func:`recv` with ``async_op=True``: returns a :class:`Work`."""
    return _p2p("dist.irecv", x, group, True, dst, src, group_dst, group_src)


def _p2p(api: str, x: PyTree, group: Group | None, async_op: bool, dst, src, group_dst, group_src):
    group = resolve_group(api, group)
    src = group_root(api, group, src, group_src, "src")
    dst = group_root(api, group, dst, group_dst, "dst")
    return _run(api, "sendrecv", x, group, async_op, pairs=((src, dst),))


@functools.lru_cache(maxsize=64)
def _barrier_token(group: Group) -> jax.Array:
    return per_rank(lambda r: 0, group)


def barrier(group: Group | None = None) -> None:
    """Return once every rank of ``group`` has taken part in one collective.

    ``torch.distributed.barrier(group)``. Lowering: an all_reduce of one int per rank over the
    group, waited on. In a multi-process run every process must call it, and none returns
    before all have called it.

    Example (8 devices)::

        >>> dist.barrier()
    """
    api = "dist.barrier"
    group = resolve_group(api, group)
    jax.block_until_ready(
        _run(api, "all_reduce", _barrier_token(group), group, False, op=ReduceOp.SUM)
    )
