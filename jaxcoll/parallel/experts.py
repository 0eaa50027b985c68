"""A mixture of experts split over an expert axis: top-k routing, capacity or dropless
dispatch, the experts' grouped matmuls, and the load statistics.

:func:`route` picks each token's experts (softmax or sigmoid scores, top-k) and, with a
capacity, which of its assignments are kept (per sequence, in GShard's order: every token's
first choice before any second choice); :func:`moe_mlp` runs the layer: the kept assignments
travel to their experts' ranks by :func:`~jaxcoll.parallel.dispatch` (one ragged all-to-all),
each rank runs its local experts on what it received with two grouped matmuls
(``jax.lax.ragged_dot``), and :func:`~jaxcoll.parallel.combine` brings the outputs back (one
ragged all-to-all), weighted by the gates. Where the expert axis is not bound every expert
is local and nothing travels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import primitives
from .._core import roles
from .axes import is_bound
from .moe import combine, dispatch
from .tensor import gelu

SCORE_FUNCS = ("softmax", "sigmoid")


class Routes(NamedTuple):
    """Each token's experts and gates, ``(..., k)``, and which assignments are kept."""

    expert: jax.Array  # int32, the chosen experts, best first
    gate: jax.Array  # the weights their outputs are summed with
    keep: jax.Array  # bool: within the capacity (all True when dropless)
    scores: jax.Array  # (..., E): every expert's score (softmax: the probabilities)


class Load(NamedTuple):
    """The layer's load over the whole batch (summed over the data axes): what
    :func:`load_metrics` reads and the auxiliary loss."""

    routed: jax.Array  # (E,) assignments each expert was chosen for
    kept: jax.Array  # (E,) of those, the ones processed (within the capacity)
    aux: jax.Array  # the load-balancing loss, E * sum_e f_e P_e (Switch Transformer)


def capacity_of(length: int, k: int, num_experts: int, factor: float | None) -> int | None:
    """Per sequence and expert, the assignments kept: ``ceil(factor * length * k / E)``
    (GShard's expert capacity, counted per sequence); None when ``factor`` is None."""
    if factor is None:
        return None
    return max(1, math.ceil(factor * length * k / num_experts))


def route(
    logits: jax.Array,
    k: int,
    *,
    score_func: str = "softmax",
    normalize: bool = False,
    capacity: int | None = None,
) -> Routes:
    """Top-``k`` routing of ``logits`` ``(B, S, E)``: each token's ``k`` best experts.

    ``scores = softmax(logits)`` (or ``sigmoid``); the gates are the chosen experts' scores,
    divided by their sum when ``normalize``. With a ``capacity``, expert ``e`` keeps at most
    ``capacity`` assignments per sequence, taken in GShard's order: the first choices of the
    sequence's tokens in position order, then the second choices, ...; the rest are dropped
    (the token goes on without that expert's output).
    """
    scores = jax.nn.softmax(logits, axis=-1) if score_func == "softmax" else jax.nn.sigmoid(logits)
    gate, expert = jax.lax.top_k(scores, k)
    if normalize:
        gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
    if capacity is None:
        keep = jnp.ones(expert.shape, bool)
    else:
        e = logits.shape[-1]
        onehot = jax.nn.one_hot(jnp.swapaxes(expert, 1, 2), e, dtype=jnp.int32)  # (B,k,S,E)
        b, _, s, _ = onehot.shape
        flat = onehot.reshape(b, k * s, e)  # slot-major: every first choice, then the second
        before = jnp.cumsum(flat, axis=1) - flat  # assignments of that expert ahead of it
        position = jnp.sum(before * flat, axis=-1).reshape(b, k, s)
        keep = jnp.swapaxes(position, 1, 2) < capacity
    return Routes(expert.astype(jnp.int32), gate, keep, scores)


def load(routes: Routes, num_experts: int, data_axes: Any) -> Load:
    """The load of ``routes`` over every token of the batch: summed over ``data_axes``
    (the axes the tokens are split over; None: this device's tokens only)."""
    onehot = jax.nn.one_hot(routes.expert, num_experts, dtype=jnp.float32)  # (..., k, E)
    routed = jnp.sum(onehot, axis=tuple(range(onehot.ndim - 1)))
    kept = jnp.sum(onehot * routes.keep[..., None], axis=tuple(range(onehot.ndim - 1)))
    probs = jnp.sum(routes.scores.astype(jnp.float32), axis=tuple(range(routes.scores.ndim - 1)))
    tokens = jnp.asarray(math.prod(routes.expert.shape[:-1]), jnp.float32)
    if data_axes is not None:  # one all-reduce of the four, side by side
        e = num_experts
        both = primitives.all_reduce(
            jnp.concatenate([routed, kept, probs, tokens[None]]), data_axes
        )
        routed, kept, probs, tokens = both[:e], both[e : 2 * e], both[2 * e : 3 * e], both[3 * e]
    k = routes.expert.shape[-1]
    fraction = routed / (tokens * k)  # f_e: the share of assignments routed to e
    aux = num_experts * jnp.sum(fraction * probs / tokens)
    return Load(routed, kept, aux)


def load_metrics(loads: list[Load]) -> dict[str, jax.Array]:
    """Scalar metrics of one step's MoE layers: ``moe_aux`` (their auxiliary losses
    summed), ``moe_dropped`` (the share of assignments dropped by the capacity) and
    ``moe_imbalance`` (the busiest expert's assignments over the mean, the worst layer)."""
    if not loads:
        return {}
    routed = jnp.sum(jnp.stack([jnp.sum(x.routed) for x in loads]))
    kept = jnp.sum(jnp.stack([jnp.sum(x.kept) for x in loads]))
    imbalance = jnp.max(jnp.stack([jnp.max(x.routed) / jnp.mean(x.routed) for x in loads]))
    return {
        "moe_aux": jnp.sum(jnp.stack([x.aux for x in loads])),
        "moe_dropped": 1.0 - kept / routed,
        "moe_imbalance": imbalance,
    }


def _grouped(rows: jax.Array, local: jax.Array, valid: jax.Array, count: int, fn: Callable):
    """``fn(sorted_rows, group_sizes)`` on ``rows`` sorted by local expert (invalid rows
    last, outside every group), its output put back in ``rows``' order."""
    key = jnp.where(valid, local, count)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((count,), jnp.int32).at[key].add(1, mode="drop")
    out = fn(rows[order], sizes)
    return jnp.zeros_like(out).at[order].set(out)


def moe_mlp(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    k: int,
    axis: Any = "expert",
    data_axes: Any = None,
    score_func: str = "softmax",
    normalize: bool = False,
    capacity_factor: float | None = None,
    activation: Callable[[jax.Array], jax.Array] = gelu,
) -> tuple[jax.Array, Load]:
    """A mixture-of-experts MLP on ``x`` ``(B, S, d)``, its experts split over ``axis``.

    Equivalent to, on one device with every expert::

        routes = route(x @ router, k, score_func=..., capacity=capacity_of(S, k, E, factor))
        y[t] = sum(routes.gate[t, j] * ffn(routes.expert[t, j], x[t])
                   for j in range(k) if routes.keep[t, j])
        ffn(e, v) = activation(v @ w_in[e]) @ w_out[e]

    Under ``jax.shard_map`` with ``axis`` bound (n devices), ``w_in`` ``(E/n, d, h)`` and
    ``w_out`` ``(E/n, h, d)`` are this device's experts (expert ``e`` on rank ``e // (E/n)``)
    and ``x`` this device's tokens: the kept assignments travel to their experts by one
    ragged all-to-all (:func:`~jaxcoll.parallel.dispatch`; dropless: room for every
    assignment of every rank), the outputs come back by another
    (:func:`~jaxcoll.parallel.combine`); the backward is the same two, reversed. Each
    all-to-all settles its sizes by one small exchange of counts (``n * n`` int32).

    Args:
        x: the tokens, ``(B, S, d)``: a batch of sequences.
        router: ``(d, E)``, the router's kernel (its logits are computed in float32).
        w_in: the local experts' first kernels, ``(E_local, d, h)``.
        w_out: their second kernels, ``(E_local, h, d)``.
        k: experts per token.
        axis: the expert axis (a role: inside a ``dp.Trainer`` the layout's expert axis);
            not bound: every expert is local.
        data_axes: the axes the batch's tokens are split over, for the load and the
            auxiliary loss over the whole batch (a role ``"batch"`` inside a Trainer);
            None: this device's tokens.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        normalize: divide the gates by their sum (DeepSeek's sigmoid routing does).
        capacity_factor: None: dropless; else each expert keeps ``ceil(factor * S * k / E)``
            assignments per sequence (:func:`route`).
        activation: the experts' nonlinearity (torch's exact ``nn.GELU()``).

    Returns:
        ``(y, load)``: ``y`` like ``x``, and the :class:`Load` of the whole batch.
    """
    b, s, d = x.shape
    num_experts = router.shape[-1]
    axis = roles.axis(axis)
    split = axis is not None and is_bound(axis)
    n = primitives.world_size(axis) if split else 1
    local = w_in.shape[0]
    if local * n != num_experts:
        raise ValueError(
            f"parallel.moe_mlp: w_in holds {local} experts on each of {n} devices, and the "
            f"router scores {num_experts}; give each device num_experts / n experts."
        )
    context = roles.axis("context")
    if capacity_factor is not None and context != "context" and is_bound(context):
        raise ValueError(
            f"parallel.moe_mlp: capacity_factor={capacity_factor} counts each expert's "
            f"assignments per sequence, and the context axis {context!r} splits every "
            f"sequence; use the dropless layer (capacity_factor=None) with context parallel."
        )
    data_axes = roles.axis(data_axes)
    if data_axes is not None and not is_bound(data_axes):
        data_axes = None
    logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), router.astype(jnp.float32))
    capacity = capacity_of(s, k, num_experts, capacity_factor)
    routes = route(logits, k, score_func=score_func, normalize=normalize, capacity=capacity)
    stats = load(routes, num_experts, data_axes)

    rows = jnp.repeat(x.reshape(b * s, d), k, axis=0)  # (T*k, d): token-major, then slot
    expert = routes.expert.reshape(-1)
    keep = routes.keep.reshape(-1)

    def ffn(v: jax.Array, sizes: jax.Array) -> jax.Array:
        h = activation(jax.lax.ragged_dot(v, w_in.astype(v.dtype), sizes))
        return jax.lax.ragged_dot(h, w_out.astype(v.dtype), sizes)

    if not split:
        out = _grouped(rows, expert, keep, num_experts, ffn)
    else:
        per_sender = b * s * k if capacity is None else min(b * s * k, b * capacity * local)
        got, mine, valid, routing = dispatch(
            rows,
            expert,
            axis,
            experts_per_rank=local,
            capacity=n * per_sender,
            keep=keep,
            max_per_rank=None if capacity is None else per_sender,
        )
        out = combine(_grouped(got, mine, valid, local, ffn), routing, axis)
    weights = (routes.gate * routes.keep).astype(out.dtype).reshape(-1, 1)
    y = jnp.sum((out * weights).reshape(b * s, k, d), axis=1)
    return y.reshape(b, s, d).astype(x.dtype), stats
