"""all_gather and gather: collect every rank's value, in rank order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import as_array_leaves, check_axis, check_rank, check_static_int
from .._typing import AxisName, PyTree
from ._axis import Axis, resolve
from ._group import group_op, is_group
from ._lowering import is_rank, staged


@staged(0, 2, 3, 4, 5)
def _gather_leaf(
    api: str, x: jax.Array, ax: Axis, axis: int, tiled: bool, algorithm: str = "native"
) -> jax.Array:
    if tiled:
        if x.ndim == 0:
            raise ValueError(f"{api}: tiled=True concatenates along an existing axis, but x is a "
                             f"scalar. Use tiled=False to stack, or reshape x to 1-D.")
        axis = check_axis(api, "axis", axis, x.ndim)
    else:
        axis = check_axis(api, "axis", axis, x.ndim + 1)
    if algorithm != "native":
        from ..algorithms import _dispatch  # lazy: the algorithms build on this module

        done = _dispatch.all_gather_leaf(api, algorithm, x, ax, axis, tiled)
        if done is not None:
            return done
    return lax.all_gather(x, ax.name, axis=axis, tiled=tiled)


def all_gather(
    x: PyTree, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
    algorithm: str = "auto",
) -> PyTree:
    """Every rank gets all ranks' ``x``, stacked along ``axis`` in rank order.

    The SPMD counterpart of ``torch.distributed.all_gather(tensor_list, tensor)`` (and of
    ``all_gather_into_tensor`` with ``tiled=True``). Equivalent to::

        def all_gather(x, axis_name, axis=0, tiled=False):
            xs = [x_of_rank(j) for j in range(world_size(axis_name))]
            return jnp.concatenate(xs, axis) if tiled else jnp.stack(xs, axis)

    Lowering: one ``lax.all_gather`` (HLO all-gather; NCCL all_gather on GPU). Any dtype.
    ``jax.grad`` gives each rank the sum over ranks of the cotangent of its own slice (the
    transpose is a reduce-scatter).

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        axis: where the new rank axis goes (``tiled=False``, ``0..x.ndim``) or which axis to
            concatenate along (``tiled=True``, ``0..x.ndim-1``). Negative values count from the end.
        tiled: concatenate instead of stacking.
        algorithm: ``"native"`` (the lowering above), ``"ring"``, ``"tree"`` (Bruck),
            ``"hierarchical"`` (tuple axis_name) or ``"auto"``; see :mod:`jaxcoll.algorithms`.

    Returns:
        A new pytree; each leaf has a new axis of size n (or ``axis`` n times longer).

    Note:
        torch fills a list of n tensors; here the list is an extra array axis.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: all_gather(v, "x")[None], mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.array([1.0, 2.0, 3.0, 4.0]))[0]
        Array([[1.], [2.], [3.], [4.]], dtype=float32)
    """
    if is_group(axis_name):
        return group_op("all_gather", x, axis_name, axis=axis, tiled=tiled)
    ax = resolve("all_gather", axis_name)
    axis = check_static_int("all_gather", "axis", axis)
    leaves, treedef = as_array_leaves("all_gather", x)
    out = [_gather_leaf("all_gather", leaf, ax, axis, bool(tiled), algorithm) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def gather(
    x: PyTree, axis_name: AxisName, dst: int, *, axis: int = 0, tiled: bool = False
) -> PyTree:
    """Rank ``dst`` gets all ranks' ``x`` stacked in rank order; other ranks get zeros.

    The SPMD counterpart of ``torch.distributed.gather(tensor, gather_list, dst)``.
    Equivalent to::

        def gather(x, axis_name, dst, axis=0, tiled=False):
            g = all_gather(x, axis_name, axis=axis, tiled=tiled)
            return g if rank(axis_name) == dst else jnp.zeros_like(g)

    Lowering: ``lax.all_gather`` then a select on the rank (lax has no rooted gather; every
    rank receives the data and non-destinations discard it).

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        dst: the destination rank, a static int in ``0..world_size-1``.
        axis: as in :func:`all_gather`.
        tiled: as in :func:`all_gather`.

    Returns:
        A new pytree: the gathered leaves on ``dst``, zeros of the same shape elsewhere.

    Note:
        Under SPMD every rank's result has one shape, so non-destination ranks get zeros where
        torch gives them nothing (``gather_list=None``).

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: gather(v, "x", dst=0)[None], mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.array([1.0, 2.0, 3.0, 4.0]))[:, :, 0]
        Array([[1., 2., 3., 4.], [0., 0., 0., 0.], [0., 0., 0., 0.], [0., 0., 0., 0.]], ...)
    """
    if is_group(axis_name):
        return group_op("gather", x, axis_name, dst=dst, axis=axis, tiled=tiled)
    ax = resolve("gather", axis_name)
    dst = check_rank("gather", "dst", dst, ax.size)
    axis = check_static_int("gather", "axis", axis)
    leaves, treedef = as_array_leaves("gather", x)
    out = [_rooted_gather_leaf(leaf, ax, dst, axis, bool(tiled)) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


@staged(1, 2, 3, 4)
def _rooted_gather_leaf(x: jax.Array, ax: Axis, dst: int, axis: int, tiled: bool) -> jax.Array:
    g = _gather_leaf("gather", x, ax, axis, tiled)
    return jnp.where(is_rank(ax, dst), g, jnp.zeros_like(g))
