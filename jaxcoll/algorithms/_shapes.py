"""Shape plumbing shared by the ppermute-built algorithms (ring, tree, hierarchical).

Each of them gathers a whole leaf to ``(n, *s)`` and reduce-scatters ``(n, m)`` rows; these
put the results where ``all_gather`` and ``reduce_scatter`` put them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from .._core.axis import Axis
from .._core.ops import ReduceOp
from .._core.packing import place_gathered, split_leading, unsplit_slice


def gather_placed(
    stacked_fn: Callable[[jax.Array, Axis], jax.Array],
    x: jax.Array,
    ax: Axis,
    axis: int,
    tiled: bool,
) -> jax.Array:
    """``all_gather(x, axis=axis, tiled=tiled)`` from an algorithm's ``(n, *x.shape)``."""
    return place_gathered(stacked_fn(x, ax), axis, tiled)


def scatter_rows(
    rows_fn: Callable[..., jax.Array],
    x: jax.Array,
    ax: Axis,
    op: ReduceOp,
    kind: str,
    dim: int,
    tiled: bool,
) -> jax.Array:
    """``reduce_scatter(x, scatter_dimension=dim, tiled=tiled)`` from an algorithm's
    reduce-scatter of ``(n, m)`` rows."""
    parts = split_leading(x, dim, ax.size, tiled)
    out = rows_fn(parts.reshape(ax.size, -1), ax, op, kind)
    return unsplit_slice(out.reshape(parts.shape[1:]), dim, tiled)
