"""all_to_all: rank r gets slice r of every rank's value, in rank order."""

from __future__ import annotations

import jax

from .._core import lowering
from .._core.axis import resolve
from .._core.checks import as_array_leaves, check_axis, check_split
from .._core.protocol import handler
from .._core.typing import AxisName, PyTree


def all_to_all(
    x: PyTree,
    axis_name: AxisName,
    split_axis: int = 0,
    concat_axis: int = 0,
    *,
    tiled: bool = False,
) -> PyTree:
    """Rank r gets slice r of every rank's ``x``, stacked (or concatenated) in rank order.

    The SPMD counterpart of ``torch.distributed.all_to_all`` / ``all_to_all_single``.
    Equivalent to::

        def all_to_all(x, axis_name, split_axis=0, concat_axis=0, tiled=False):
            r = rank(axis_name)
            if tiled:   # split into n chunks, concatenate the received chunks
                chunks = [jnp.split(x_of_rank(j), n, split_axis)[r] for j in range(n)]
                return jnp.concatenate(chunks, concat_axis)
            # untiled: x.shape[split_axis] == n; that axis is dropped, a rank axis inserted
            slices = [x_of_rank(j).take(r, split_axis) for j in range(n)]
            return jnp.stack(slices, concat_axis)

    Lowering: one ``lax.all_to_all`` (HLO all-to-all; NCCL send/recv groups on GPU). Any dtype;
    ``jax.grad`` is the all-to-all back.

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        split_axis: the axis to split among ranks: size n (untiled) or a multiple of n (tiled).
        concat_axis: where the received pieces go.
        tiled: concatenate chunks instead of stacking slices.

    Returns:
        A new pytree.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: all_to_all(v, "x", 0, 0, tiled=True), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(16.0))        # rank j holds [4j .. 4j+3]; rank r gets [r, 4+r, 8+r, 12+r]
        Array([ 0.,  4.,  8., 12.,  1.,  5.,  9., 13.,  2., ...], dtype=float32)
    """
    if (own := handler(axis_name)) is not None:
        return own(all_to_all, x, split_axis=split_axis, concat_axis=concat_axis, tiled=tiled)
    api = "all_to_all"
    ax = resolve(api, axis_name)
    leaves, treedef = as_array_leaves(api, x)
    out = []
    for leaf in leaves:
        s = check_split(api, leaf.shape, split_axis, ax.size, bool(tiled), "split_axis")
        c = check_axis(api, "concat_axis", concat_axis, leaf.ndim)
        out.append(lowering.all_to_all(leaf, ax, s, c, bool(tiled)))
    return jax.tree_util.tree_unflatten(treedef, out)
