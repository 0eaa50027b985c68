"""Prefix reductions over a group's ranks (mpi4jax's ``scan``/``exscan``; torch has none)."""

from __future__ import annotations

from .._core.ops import ReduceOp
from .._core.typing import PyTree
from ..groups import Group
from ._collectives import _op, _run
from ._group import resolve_group
from ._work import Work


def scan(
    x: PyTree, op: ReduceOp | str = ReduceOp.SUM, group: Group | None = None, async_op: bool = False
) -> PyTree | Work:
    """Rank r gets ``op`` over the values of group ranks 0..r (``MPI_Scan``).

    jaxcoll's own (torch.distributed has no prefix reduction; mpi4jax calls it ``scan``).
    Equivalent to ``per_rank([functools.reduce(op, rows[:r + 1]) for r in range(n)])``.
    Lowering: :func:`jaxcoll.primitives.scan` (ceil(log2 n) ppermutes, Hillis-Steele). Every
    op and dtype pair the primitive allows; AVG is the mean of ranks 0..r.

    Example (8 devices)::

        >>> dist.to_ranks(dist.scan(dist.per_rank(np.arange(1.0, 9.0))))[3]
        array(10., dtype=float32)
    """
    api = "dist.scan"
    group = resolve_group(api, group)
    return _run(api, "scan", x, group, async_op, op=_op(api, x, op))


def exscan(
    x: PyTree, op: ReduceOp | str = ReduceOp.SUM, group: Group | None = None, async_op: bool = False
) -> PyTree | Work:
    """Rank r gets ``op`` over the values of group ranks 0..r-1 (``MPI_Exscan``); rank 0 gets
    the op's identity (see :func:`jaxcoll.primitives.exscan`; MPI leaves it undefined).

    Example (8 devices)::

        >>> dist.to_ranks(dist.exscan(dist.per_rank(np.arange(1.0, 9.0))))[:2]
        [array(0., dtype=float32), array(1., dtype=float32)]
    """
    api = "dist.exscan"
    group = resolve_group(api, group)
    return _run(api, "exscan", x, group, async_op, op=_op(api, x, op))
