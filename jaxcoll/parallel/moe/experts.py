"""The experts' compute: each rank runs its local experts on the assignments routed to them,
by two grouped matmuls (``jax.lax.ragged_dot``); where the expert axis is bound the
assignments travel to their experts' ranks and back (:func:`~jaxcoll.parallel.dispatch`,
:func:`~jaxcoll.parallel.combine`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ... import primitives
from ..._core.typing import AxisName
from .exchange import combine, dispatch


def _grouped(rows: jax.Array, local: jax.Array, valid: jax.Array, count: int, fn: Callable):
    """``fn(sorted_rows, group_sizes)`` on ``rows`` sorted by local expert (invalid rows
    last, outside every group), its output put back in ``rows``' order."""
    key = jnp.where(valid, local, count)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((count,), jnp.int32).at[key].add(1, mode="drop")
    out = fn(rows[order], sizes)
    return jnp.zeros_like(out).at[order].set(out)


def run_experts(
    rows: jax.Array,
    expert: jax.Array,
    keep: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    axis_name: AxisName | None,
    max_per_rank: int | None,
) -> jax.Array:
    """Each assignment through its expert: ``activation(row @ w_in[e]) @ w_out[e]``.

    Args:
        rows: ``(R, d)``, the assignments (a token's row once per chosen expert).
        expert: ``(R,)`` int, each assignment's expert (its global id).
        keep: ``(R,)`` bool, the assignments to compute (the others give zeros).
        w_in: this rank's experts' first kernels, ``(E_local, d, h)``.
        w_out: their second kernels, ``(E_local, h, d)``.
        activation: the experts' nonlinearity.
        axis_name: the bound expert axis (expert ``e`` on rank ``e // E_local``), or None:
            every expert is local and nothing travels.
        max_per_rank: the most assignments this rank sends to any one rank (a capacity
            bounds it), or None (dropless: room for every assignment of every rank).

    Returns:
        ``(R, d)``: the outputs, in ``rows``' order, zeros where not kept.
    """

    def ffn(v: jax.Array, sizes: jax.Array) -> jax.Array:
        h = activation(jax.lax.ragged_dot(v, w_in.astype(v.dtype), sizes))
        return jax.lax.ragged_dot(h, w_out.astype(v.dtype), sizes)

    local = w_in.shape[0]
    if axis_name is None:
        return _grouped(rows, expert, keep, local, ffn)
    n = primitives.world_size(axis_name)
    per_sender = rows.shape[0] if max_per_rank is None else max_per_rank
    got, mine, valid, routing = dispatch(
        rows,
        expert,
        axis_name,
        experts_per_rank=local,
        capacity=n * per_sender,
        keep=keep,
        max_per_rank=max_per_rank,
    )
    return combine(_grouped(got, mine, valid, local, ffn), routing, axis_name)
