"""The experts' compute: each rank runs its local experts on the assignments routed to them,
by two grouped matmuls (``jax.lax.ragged_dot``); where the expert axis is bound the
assignments travel to their experts' ranks and back (:func:`~jaxcoll.parallel.dispatch`,
:func:`~jaxcoll.parallel.combine`): in one exchange with room for every assignment (dropless),
for at most a capacity's, or, with a ``buffer_factor``, in rounds through a bounded buffer
(dropless at bounded memory, :func:`_in_rounds`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ... import primitives
from ..._core.typing import AxisName
from ..._core.vma import axis_names, cast_varying, varying_axes
from .exchange import combine, dispatch


def check_buffer_factor(
    api: str, factor: float | None, capacity_factor: float | None, hierarchical: bool = False
) -> None:
    """Raise ValueError for a ``buffer_factor`` :func:`~jaxcoll.parallel.moe_mlp` refuses:
    one that is not a positive finite number or None, or one beside a capacity or the
    two-level exchange (which sizes its own buffers)."""
    if factor is None:
        return
    number = isinstance(factor, (int, float, np.integer, np.floating))
    if isinstance(factor, bool) or not (number and math.isfinite(factor) and factor > 0):
        raise ValueError(
            f"{api}: buffer_factor={factor!r} must be a positive number (each device's "
            f"receive buffer holds factor times the balanced load), or None (room for "
            f"every assignment)."
        )
    if capacity_factor is not None:
        raise ValueError(
            f"{api}: buffer_factor={factor} bounds the dropless exchange, and "
            f"capacity_factor={capacity_factor} already bounds it (dropping); pass one of "
            f"them."
        )
    if hierarchical:
        raise ValueError(
            f"{api}: buffer_factor={factor} bounds the flat exchange; the two-level one "
            f"(hierarchical=True) sizes its own buffers. Pass hierarchical=False, or "
            f"buffer_factor=None."
        )


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
    buffer_factor: float | None = None,
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
        buffer_factor: dropless at bounded memory (with ``max_per_rank=None``): each rank's
            receive buffer holds ``factor`` times the balanced load, and what does not fit
            travels in further rounds (:func:`_in_rounds`); None: one exchange.

    Returns:
        ``(R, d)``: the outputs, in ``rows``' order, zeros where not kept.
    """

    def ffn(v: jax.Array, sizes: jax.Array, w_in=w_in, w_out=w_out) -> jax.Array:
        h = activation(jax.lax.ragged_dot(v, w_in.astype(v.dtype), sizes))
        return jax.lax.ragged_dot(h, w_out.astype(v.dtype), sizes)

    local = w_in.shape[0]
    if axis_name is None:
        return _grouped(rows, expert, keep, local, ffn)
    n = primitives.world_size(axis_name)
    if max_per_rank is None and buffer_factor is not None:
        per_round = max(1, math.ceil(buffer_factor * rows.shape[0] / n))
        if per_round < rows.shape[0]:  # else one round holds every assignment
            args = (rows, expert, keep, w_in, w_out)
            return _in_rounds(*args, ffn=ffn, axis_name=axis_name, per_round=per_round)
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


def _in_rounds(
    rows: jax.Array,
    expert: jax.Array,
    keep: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    ffn: Callable[..., jax.Array],
    axis_name: AxisName,
    per_round: int,
) -> jax.Array:
    """Every kept assignment through its expert, ``per_round`` of them per sender and rank at
    a time: dropless through a buffer of ``n * per_round`` rows.

    Round ``r`` sends each rank's assignments ``r * per_round .. (r + 1) * per_round - 1``
    (in token order, :func:`~jaxcoll.parallel.dispatch`'s ``start``); the rounds needed,
    ``ceil(most assignments any rank sends to one rank / per_round)``, are agreed by one
    ``pmax`` over the expert axis (so every rank runs the same rounds, and the exchanges in
    them match). The rounds are one ``lax.scan`` over the most rounds any routing needs,
    ``ceil(T * k / per_round)``; each is a ``lax.cond`` (a round not needed costs only the
    branch) rematerialised (:func:`_recomputed`): the backward recomputes a round's buffers
    instead of keeping them, so the program holds one round's buffers whatever the rounds
    (the scan keeps no per-round residual beyond its index). Each assignment's output comes from the
    one round that sent it (zeros from the others): the sum equals one exchange of every
    assignment.
    """
    n = primitives.world_size(axis_name)
    local = w_in.shape[0]
    total = rows.shape[0]
    dest = jnp.where(keep, expert // local, n)
    sent = jnp.zeros((n,), jnp.int32).at[dest].add(1, mode="drop")
    needed = jax.lax.pmax((jnp.max(sent) + per_round - 1) // per_round, axis_name)
    names = axis_names(axis_name)
    varying = set(names)
    for a in (rows, w_in, w_out):
        varying |= set(varying_axes(a) or ())
    varying_names = tuple(sorted(varying, key=str))

    def exchange(rows, expert, keep, w_in, w_out, start):
        def run(v: jax.Array, sizes: jax.Array) -> jax.Array:
            return ffn(v, sizes, w_in, w_out)

        got, mine, valid, routing = dispatch(
            rows, expert, axis_name, experts_per_rank=local, capacity=n * per_round,
            keep=keep, max_per_rank=per_round, start=start,
        )  # fmt: skip
        out = combine(_grouped(got, mine, valid, local, run), routing, axis_name)
        return cast_varying(out, varying_names)

    def one_round(r, rows, expert, keep, w_in, w_out, needed):
        def skip(*_):
            return cast_varying(jnp.zeros_like(rows), varying_names)

        args = (rows, expert, keep, w_in, w_out, r * per_round)
        return jax.lax.cond(r < needed, exchange, skip, *args)

    remat = _recomputed(one_round)

    out = cast_varying(jnp.zeros_like(rows), varying_names)
    rounds = jnp.arange(math.ceil(total / per_round), dtype=jnp.int32)

    def step(acc: jax.Array, r: jax.Array) -> tuple[jax.Array, None]:
        return acc + remat(r, rows, expert, keep, w_in, w_out, needed), None

    return jax.lax.scan(step, out, rounds)[0]


def _recomputed(one_round: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``one_round(r, rows, expert, keep, w_in, w_out, needed)`` rematerialised by hand: a
    ``jax.custom_vjp`` whose forward keeps only its inputs and whose backward runs it again
    (``jax.vjp``), so a round's buffers are never saved for the backward, whatever
    checkpoint policy surrounds the loss (a plain ``jax.checkpoint`` here is overridden by
    one around it that saves everything, as FSDP's ``reshard_after_forward`` has: its
    residuals, every round's buffers, would then be stacked by the scan)."""
    remat = jax.custom_vjp(one_round)

    def forward(*args):
        return one_round(*args), args

    def backward(args, ct):
        r, rows, expert, keep, w_in, w_out, needed = args

        def differentiable(rows, w_in, w_out):
            return one_round(r, rows, expert, keep, w_in, w_out, needed)

        g_rows, g_in, g_out = jax.vjp(differentiable, rows, w_in, w_out)[1](ct)
        return None, g_rows, None, None, g_in, g_out, None

    remat.defvjp(forward, backward)
    return remat
