"""scatter: rank r gets slice r of rank ``src``'s value."""

from __future__ import annotations

import jax
from jax import lax

from .._checks import as_array_leaves, check_axis, check_divisible, check_leading, check_rank
from .._typing import AxisName, PyTree
from ._axis import Axis, resolve
from ._group import group_op, is_group
from ._lowering import split_leading, staged, unsplit_slice


@staged(1, 2, 3, 4)
def _scatter_leaf(x: jax.Array, ax: Axis, src: int, axis: int, tiled: bool) -> jax.Array:
    api = "scatter"
    if x.ndim == 0:
        raise ValueError(f"{api}: x is a scalar, but it must hold {ax.size} slices along `axis` "
                         f"(one per rank).")
    axis = check_axis(api, "axis", axis, x.ndim)
    n = ax.size
    if tiled:
        check_divisible(api, f"x.shape[{axis}]", x.shape[axis], n,
                        "Pad x so that every rank gets an equal slice.")
    else:
        check_leading(api, f"x.shape[{axis}]", x.shape[axis], n,
                      "Stack one slice per rank along `axis`, or use tiled=True to split a "
                      "longer axis into equal chunks.")
    parts = split_leading(x, axis, n, tiled)
    if n == 1:
        return unsplit_slice(parts[0], axis, tiled)
    rows = lax.all_to_all(parts, ax.name, 0, 0, tiled=False)  # rows[j] = slice r of rank j
    return unsplit_slice(rows[src], axis, tiled)


def scatter(
    x: PyTree, axis_name: AxisName, src: int, *, axis: int = 0, tiled: bool = False
) -> PyTree:
    """Rank r gets slice r of rank ``src``'s ``x``; other ranks' ``x`` is ignored.

    The SPMD counterpart of ``torch.distributed.scatter(tensor, scatter_list, src)``, with
    ``scatter_list`` stacked along ``axis``. Equivalent to::

        def scatter(x, axis_name, src, axis=0, tiled=False):
            parts = jnp.split(x_of_rank(src), n, axis)           # tiled
            # untiled: parts = [x_of_rank(src).take(i, axis) for i in range(n)]
            return parts[rank(axis_name)]

    Lowering: one ``lax.all_to_all`` (HLO all-to-all) then the row from ``src`` is kept; bit-exact
    for every dtype. (lax has no rooted scatter; the all-to-all moves the same (n-1)/n of x per
    rank as a ring scatter would, in one collective.)

    Args:
        x: an array or a pytree of arrays with ``n`` slices along ``axis``
            (``x.shape[axis] == n``, or divisible by n when ``tiled``).
        axis_name: mesh axis name or tuple of names.
        src: the source rank, a static int in ``0..world_size-1``.
        axis: the axis that holds the slices.
        tiled: split ``axis`` into n equal chunks (kept) instead of n slices (dropped).

    Returns:
        A new pytree: slice r of ``src``'s leaves.

    Note:
        Under SPMD every rank passes an ``x`` of the same shape; only ``src``'s is read.

    Example (4 devices, as in the torch tutorial)::

        >>> data = jnp.tile(jnp.array([1.0, 2.0, 3.0, 4.0]), 4)   # each rank's row: [1,2,3,4]
        >>> f = jax.shard_map(lambda v: scatter(v, "x", src=0, tiled=True), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(data)
        Array([1., 2., 3., 4.], dtype=float32)
    """
    if is_group(axis_name):
        return group_op("scatter", x, axis_name, src=src, axis=axis, tiled=tiled)
    ax = resolve("scatter", axis_name)
    src = check_rank("scatter", "src", src, ax.size)
    leaves, treedef = as_array_leaves("scatter", x)
    out = [_scatter_leaf(leaf, ax, src, axis, bool(tiled)) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)
