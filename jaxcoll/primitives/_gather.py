"""all_gather and gather: collect every rank's value, in rank order."""

from __future__ import annotations

import jax

from .._core import lowering
from .._core.axis import resolve
from .._core.checks import as_array_leaves, check_gather_dim, check_rank, map_leaves
from .._core.protocol import dispatch
from .._core.typing import AxisName, PyTree
from ..algorithms import registry


@dispatch
def all_gather(
    x: PyTree,
    axis_name: AxisName,
    *,
    dim: int = 0,
    tiled: bool = False,
    algorithm: str = "auto",
) -> PyTree:
    """Every rank gets all ranks' ``x``, stacked along ``dim`` in rank order.

    The SPMD counterpart of ``torch.distributed.all_gather(tensor_list, tensor)`` (and of
    ``all_gather_into_tensor`` with ``tiled=True``). Equivalent to::

        def all_gather(x, axis_name, dim=0, tiled=False):
            xs = [x_of_rank(j) for j in range(world_size(axis_name))]
            return jnp.concatenate(xs, dim) if tiled else jnp.stack(xs, dim)

    Lowering: one ``lax.all_gather`` (HLO all-gather; NCCL all_gather on GPU), typed invariant
    (the same on every rank, so ``out_specs=P()`` checks). Any dtype.
    ``jax.grad`` gives each rank the sum over ranks of the cotangent of its own slice (the
    transpose is a reduce-scatter).

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        dim: where the new rank dimension goes (``tiled=False``, ``0..x.ndim``) or which
            dimension to concatenate along (``tiled=True``, ``0..x.ndim-1``). Negative values
            count from the end.
        tiled: concatenate instead of stacking.
        algorithm: ``"native"`` (the lowering above), ``"ring"``, ``"tree"`` (Bruck),
            ``"hierarchical"`` (tuple axis_name) or ``"auto"``; see :mod:`jaxcoll.algorithms`.

    Returns:
        A new pytree; each leaf has a new dimension of size n (or ``dim`` n times longer).

    Note:
        torch fills a list of n tensors; here the list is an extra array dimension.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: all_gather(v, "x")[None], mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.array([1.0, 2.0, 3.0, 4.0]))[0]
        Array([[1.], [2.], [3.], [4.]], dtype=float32)
    """
    api = "all_gather"
    ax = resolve(api, axis_name)
    leaves, treedef = as_array_leaves(api, x)
    dims = [check_gather_dim(api, leaf.shape, dim, bool(tiled)) for leaf in leaves]
    out = registry.run(
        api,
        api,
        algorithm,
        leaves,
        ax,
        lambda mod, v, i: mod.all_gather(v, ax, dims[i], bool(tiled)),
        by_dtype=False,
    )
    return jax.tree_util.tree_unflatten(treedef, out)


@dispatch
def gather(
    x: PyTree, axis_name: AxisName, dst: int, *, dim: int = 0, tiled: bool = False
) -> PyTree:
    """Rank ``dst`` gets all ranks' ``x`` stacked in rank order; other ranks get zeros.

    The SPMD counterpart of ``torch.distributed.gather(tensor, gather_list, dst)``.
    Equivalent to::

        def gather(x, axis_name, dst, dim=0, tiled=False):
            g = all_gather(x, axis_name, dim=dim, tiled=tiled)
            return g if rank(axis_name) == dst else jnp.zeros_like(g)

    Lowering: ``lax.all_gather`` then a select on the rank (lax has no rooted gather; every
    rank receives the data and non-destinations discard it).

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        dst: the destination rank, a static int in ``0..world_size-1``.
        dim: as in :func:`all_gather`.
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
    ax = resolve("gather", axis_name)
    dst = check_rank("gather", "dst", dst, ax.size)
    tiled = bool(tiled)
    return map_leaves(
        "gather",
        x,
        lambda leaf: lowering.gather(
            leaf, ax, dst, check_gather_dim("gather", leaf.shape, dim, tiled), tiled
        ),
    )
