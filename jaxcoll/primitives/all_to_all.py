"""all_to_all: rank r gets slice r of every rank's value, in rank order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import as_array_leaves, check_axis, check_divisible, check_leading
from .._typing import AxisName, PyTree
from ._axis import resolve
from ._group import group_op, is_group
from ._lowering import staged


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
    if is_group(axis_name):
        return group_op("all_to_all", x, axis_name, split_axis=split_axis,
                        concat_axis=concat_axis, tiled=tiled)
    api = "all_to_all"
    ax = resolve(api, axis_name)
    n = ax.size
    leaves, treedef = as_array_leaves(api, x)
    out = []
    for leaf in leaves:
        if leaf.ndim == 0:
            raise ValueError(f"{api}: x is a scalar, but it must hold {n} slices along split_axis.")
        s = check_axis(api, "split_axis", split_axis, leaf.ndim)
        c = check_axis(api, "concat_axis", concat_axis, leaf.ndim)
        if tiled:
            check_divisible(api, f"x.shape[{s}] (split_axis)", leaf.shape[s], n,
                            "Pad split_axis to a multiple of the group size.")
        else:
            check_leading(api, f"x.shape[{s}] (split_axis)", leaf.shape[s], n,
                          "Put one slice per rank along split_axis, or use tiled=True.")
        out.append(lax.all_to_all(leaf, ax.name, s, c, tiled=True) if tiled
                   else untiled_all_to_all(leaf, ax.name, s, c))
    return jax.tree_util.tree_unflatten(treedef, out)


@staged(1, 2, 3)
def untiled_all_to_all(x: jax.Array, name, split_axis: int, concat_axis: int) -> jax.Array:
    """Untiled all_to_all expressed with the tiled primitive over an inserted unit axis.

    This is the reshaping ``lax.all_to_all`` does itself, done here so that ``jax.grad`` works:
    in jax 0.10 the transpose of an untiled all_to_all with ``split_axis != concat_axis``
    inserts the unit axis a second time and fails with a cotangent shape error.
    """
    if split_axis == concat_axis:
        return lax.all_to_all(x, name, split_axis, concat_axis, tiled=True)
    if split_axis < concat_axis:
        concat_axis += 1
    else:
        split_axis += 1
    y = jnp.expand_dims(x, concat_axis)
    out = lax.all_to_all(y, name, split_axis, concat_axis, tiled=True)
    return jnp.squeeze(out, split_axis)
