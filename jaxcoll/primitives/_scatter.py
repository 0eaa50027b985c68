"""scatter: rank r gets slice r of rank ``src``'s value."""

from __future__ import annotations

from .._core import lowering
from .._core.axis import resolve
from .._core.checks import check_rank, check_split, map_leaves
from .._core.protocol import dispatch
from .._core.typing import AxisName, PyTree


@dispatch
def scatter(
    x: PyTree, axis_name: AxisName, src: int, *, dim: int = 0, tiled: bool = False
) -> PyTree:
    """Rank r gets slice r of rank ``src``'s ``x``; other ranks' ``x`` is ignored.

    The SPMD counterpart of ``torch.distributed.scatter(tensor, scatter_list, src)``, with
    ``scatter_list`` stacked along ``dim``. Equivalent to::

        def scatter(x, axis_name, src, dim=0, tiled=False):
            parts = jnp.split(x_of_rank(src), n, dim)            # tiled
            # untiled: parts = [x_of_rank(src).take(i, dim) for i in range(n)]
            return parts[rank(axis_name)]

    Lowering: one ``lax.all_to_all`` (HLO all-to-all) then the row from ``src`` is kept; bit-exact
    for every dtype. (lax has no rooted scatter; the all-to-all moves the same (n-1)/n of x per
    rank as a ring scatter would, in one collective.)

    Args:
        x: an array or a pytree of arrays with ``n`` slices along ``dim``
            (``x.shape[dim] == n``, or divisible by n when ``tiled``).
        axis_name: mesh axis name or tuple of names.
        src: the source rank, a static int in ``0..world_size-1``.
        dim: the dimension that holds the slices.
        tiled: split ``dim`` into n equal chunks (kept) instead of n slices (dropped).

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
    ax = resolve("scatter", axis_name)
    src = check_rank("scatter", "src", src, ax.size)
    tiled = bool(tiled)
    return map_leaves(
        "scatter",
        x,
        lambda leaf: lowering.scatter(
            leaf, ax, src, check_split("scatter", leaf.shape, dim, ax.size, tiled), tiled
        ),
    )
