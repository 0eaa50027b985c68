"""reduce_scatter: rank r gets slice r of the reduction over all ranks, for every op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import as_array_leaves, check_axis, check_divisible, check_leading
from .._ops import ReduceOp, check_op_dtype, coerce_op
from .._typing import AxisName, PyTree
from ._axis import Axis, resolve
from ._group import group_op, is_group
from ._lowering import reduce_scatter_leading, split_leading, staged, unsplit_slice


@staged(1, 2, 3, 4, 5, 6)
def reduce_scatter_leaf(
    x: jax.Array, ax: Axis, op: ReduceOp, kind: str, dim: int, tiled: bool,
    algorithm: str = "native",
) -> jax.Array:
    """Reduce-scatter one validated leaf."""
    api = "reduce_scatter"
    n = ax.size
    if x.ndim == 0:
        raise ValueError(f"{api}: x is a scalar, but it must hold {n} slices along "
                         f"scatter_dimension (one per rank).")
    dim = check_axis(api, "scatter_dimension", dim, x.ndim)
    if tiled:
        check_divisible(api, f"x.shape[{dim}]", x.shape[dim], n,
                        "Pad that dimension to a multiple of the group size.")
    else:
        check_leading(api, f"x.shape[{dim}]", x.shape[dim], n,
                      "Stack one slice per rank along scatter_dimension, or use tiled=True.")
    if algorithm != "native":
        from ..algorithms import _dispatch  # lazy: the algorithms build on this module

        parts = split_leading(x, dim, n, tiled)
        done = _dispatch.reduce_scatter_parts(api, algorithm, parts, ax, op, kind)
        if done is not None:
            return unsplit_slice(done, dim, tiled)
    if kind != "bool" and op in (ReduceOp.SUM, ReduceOp.AVG):
        out = lax.psum_scatter(x, ax.name, scatter_dimension=dim, tiled=tiled)
        if op is ReduceOp.AVG:
            out = out / jnp.asarray(n, out.dtype)
        return out
    parts = split_leading(x, dim, n, tiled)
    return unsplit_slice(reduce_scatter_leading(parts, ax, op, kind), dim, tiled)


def reduce_scatter(
    x: PyTree,
    axis_name: AxisName,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    scatter_dimension: int = 0,
    tiled: bool = False,
    algorithm: str = "auto",
) -> PyTree:
    """Rank r gets slice r (along ``scatter_dimension``) of ``op`` over every rank's ``x``.

    The SPMD counterpart of ``torch.distributed.reduce_scatter`` /
    ``reduce_scatter_tensor``, for every reduce op. Equivalent to::

        def reduce_scatter(x, axis_name, op, scatter_dimension=0, tiled=False):
            total = all_reduce(x, axis_name, op)
            return jnp.split(total, n, scatter_dimension)[rank(axis_name)]   # tiled
            # untiled: total.take(rank(axis_name), scatter_dimension)

    Lowering: SUM and AVG on numbers: one ``lax.psum_scatter`` (HLO reduce-scatter; NCCL
    reduce_scatter on GPU), AVG then divides by n. Every other op, and bool: one
    ``lax.all_to_all`` that brings slice r of every rank to rank r, then one local reduce:
    exact, and the same bytes on the wire as a native reduce-scatter.

    Args:
        x: an array or a pytree of arrays; ``x.shape[scatter_dimension]`` must be n (untiled)
            or a multiple of n (tiled).
        axis_name: mesh axis name or tuple of names.
        op: a :class:`~jaxcoll.ReduceOp` or its name (dtype rules as :func:`all_reduce`).
        scatter_dimension: the dimension to split among ranks.
        tiled: keep ``scatter_dimension`` (n times shorter) instead of dropping it.
        algorithm: ``"native"`` (the lowering above), ``"ring"``, ``"tree"``,
            ``"hierarchical"`` (tuple axis_name) or ``"auto"``; see :mod:`jaxcoll.algorithms`.

    Returns:
        A new pytree: slice r of the reduction on rank r.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: reduce_scatter(v, "x", op="max", tiled=True),
        ...                   mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(16.0))        # rank j holds [4j, 4j+1, 4j+2, 4j+3]
        Array([12., 13., 14., 15.], dtype=float32)
    """
    if is_group(axis_name):
        return group_op("reduce_scatter", x, axis_name, op=op,
                        scatter_dimension=scatter_dimension, tiled=tiled)
    api = "reduce_scatter"
    op = coerce_op(api, op)
    ax = resolve(api, axis_name)
    leaves, treedef = as_array_leaves(api, x)
    out = []
    for leaf in leaves:
        kind = check_op_dtype(api, op, leaf.dtype)
        out.append(reduce_scatter_leaf(leaf, ax, op, kind, scatter_dimension, bool(tiled),
                                       algorithm))
    return jax.tree_util.tree_unflatten(treedef, out)
