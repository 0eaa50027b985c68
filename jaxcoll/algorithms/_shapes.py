"""Shape plumbing shared by the ppermute-built algorithms (ring, tree, hierarchical).

Each of them gathers a whole leaf to ``(n, *s)`` and reduce-scatters ``(n, m)`` rows;
:func:`leaf_ops` turns those two into the ``all_gather`` and ``reduce_scatter`` of the algorithm
interface, with the results where ``lax.all_gather`` and ``lax.psum_scatter`` put them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from .._core.axis import Axis
from .._core.ops import ReduceOp
from .._core.packing import place_gathered, split_leading, unsplit_slice

Stacked = Callable[[jax.Array, Axis], jax.Array]
"""``stacked(x, ax)``: every rank's ``x`` as ``(n, *x.shape)``, in rank order."""
Rows = Callable[[jax.Array, Axis, ReduceOp, str], jax.Array]
"""``rows(r, ax, op, kind)``: ``r`` is ``(n, m)``; rank i gets row i folded over all ranks."""


def leaf_ops(
    stacked: Stacked, rows: Rows
) -> tuple[
    Callable[[jax.Array, Axis, int, bool], jax.Array],
    Callable[[jax.Array, Axis, ReduceOp, str, int, bool], jax.Array],
]:
    """An algorithm's ``all_gather(x, ax, dim, tiled)`` and
    ``reduce_scatter(x, ax, op, kind, dim, tiled)`` of a whole leaf, from its ``stacked``
    gather and its reduce-scatter of ``rows``."""

    def all_gather(x: jax.Array, ax: Axis, dim: int, tiled: bool) -> jax.Array:
        return place_gathered(stacked(x, ax), dim, tiled)

    def reduce_scatter(
        x: jax.Array, ax: Axis, op: ReduceOp, kind: str, dim: int, tiled: bool
    ) -> jax.Array:
        parts = split_leading(x, dim, ax.size, tiled)
        out = rows(parts.reshape(ax.size, -1), ax, op, kind)
        return unsplit_slice(out.reshape(parts.shape[1:]), dim, tiled)

    return all_gather, reduce_scatter
