"""all_to_all: rank r gets slice r of every rank's value, in rank order."""

from __future__ import annotations

from .._core import lowering
from .._core.axis import resolve
from .._core.checks import check_dim, check_split, map_leaves
from .._core.protocol import dispatch
from .._core.typing import AxisName, PyTree


@dispatch
def all_to_all(
    x: PyTree,
    axis_name: AxisName,
    split_dim: int = 0,
    concat_dim: int = 0,
    *,
    tiled: bool = False,
) -> PyTree:
    """Rank r gets slice r of every rank's ``x``, stacked (or concatenated) in rank order.

    The SPMD counterpart of ``torch.distributed.all_to_all`` / ``all_to_all_single``.
    Equivalent to::

        def all_to_all(x, axis_name, split_dim=0, concat_dim=0, tiled=False):
            r = rank(axis_name)
            if tiled:   # split into n chunks, concatenate the received chunks
                chunks = [jnp.split(x_of_rank(j), n, split_dim)[r] for j in range(n)]
                return jnp.concatenate(chunks, concat_dim)
            # untiled: x.shape[split_dim] == n; that dimension is dropped, a rank one inserted
            slices = [x_of_rank(j).take(r, split_dim) for j in range(n)]
            return jnp.stack(slices, concat_dim)

    Lowering: one ``lax.all_to_all`` (HLO all-to-all; NCCL send/recv groups on GPU). Any dtype;
    ``jax.grad`` is the all-to-all back.

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        split_dim: the dimension to split among ranks: size n (untiled) or a multiple of n
            (tiled).
        concat_dim: where the received pieces go.
        tiled: concatenate chunks instead of stacking slices.

    Returns:
        A new pytree.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: all_to_all(v, "x", 0, 0, tiled=True), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(16.0))        # rank j holds [4j .. 4j+3]; rank r gets [r, 4+r, 8+r, 12+r]
        Array([ 0.,  4.,  8., 12.,  1.,  5.,  9., 13.,  2., ...], dtype=float32)
    """
    api = "all_to_all"
    ax = resolve(api, axis_name)
    tiled = bool(tiled)

    def one(leaf):
        s = check_split(api, leaf.shape, split_dim, ax.size, tiled, "split_dim")
        c = check_dim(api, "concat_dim", concat_dim, leaf.ndim)
        return lowering.all_to_all(leaf, ax, s, c, tiled)

    return map_leaves(api, x, one)
