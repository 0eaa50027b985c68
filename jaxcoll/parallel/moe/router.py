"""Top-k routing: each token's experts and gates, and, with a capacity, which of its
assignments each expert keeps (per sequence, in GShard's order)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

SCORE_FUNCS = ("softmax", "sigmoid")


class Routes(NamedTuple):
    """Each token's experts and gates, ``(..., k)``, and which assignments are kept."""

    expert: jax.Array  # int32, the chosen experts, best first
    gate: jax.Array  # the weights their outputs are summed with
    keep: jax.Array  # bool: within the capacity (all True when dropless)
    scores: jax.Array  # (..., E): every expert's score (softmax: the probabilities)


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
    bias: jax.Array | None = None,
    groups: int | None = None,
    group_limit: int | None = None,
) -> Routes:
    """Top-``k`` routing of ``logits`` ``(B, S, E)``: each token's ``k`` best experts.

    ``scores = softmax(logits)`` (or ``sigmoid``); the gates are the chosen experts' scores,
    divided by their sum when ``normalize``. With a ``capacity``, expert ``e`` keeps at most
    ``capacity`` assignments per sequence, taken in GShard's order: the first choices of the
    sequence's tokens in position order, then the second choices, ...; the rest are dropped
    (the token goes on without that expert's output). With a ``bias`` ``(E,)`` (DeepSeek-V3's
    auxiliary-loss-free balancing) the experts are the top ``k`` of ``scores + bias`` and the
    gates still the chosen experts' unbiased ``scores``; the bias gets no gradient. With
    ``groups`` and ``group_limit`` (node-limited routing, DeepSeek-V3's ``n_group`` and
    ``topk_group``) the ``E`` experts form ``groups`` contiguous groups (a node's experts
    each) and each token chooses only among the ``group_limit`` groups of best group score
    (the group's best expert score; the sum of its two best with a ``bias``), the gates still
    the unlimited scores. The arguments are those :func:`~jaxcoll.parallel.moe_mlp` checked.
    """
    scores = jax.nn.softmax(logits, axis=-1) if score_func == "softmax" else jax.nn.sigmoid(logits)
    if bias is None and groups is None:
        gate, expert = jax.lax.top_k(scores, k)
    else:  # the bias and the groups choose the experts only: the gates are the plain scores
        choose = scores
        if bias is not None:
            choose = scores + jax.lax.stop_gradient(bias).astype(scores.dtype)
        if groups is not None and group_limit is not None:
            choose = limit_groups(choose, groups, group_limit, best=1 if bias is None else 2)
        _, expert = jax.lax.top_k(choose, k)
        gate = jnp.take_along_axis(scores, expert, axis=-1)
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


def limit_groups(choose: jax.Array, groups: int, group_limit: int, best: int = 1) -> jax.Array:
    """``choose`` ``(..., E)`` with every expert outside each token's ``group_limit`` best of
    ``groups`` contiguous groups set to ``-inf`` (node-limited routing). A group's score is
    the sum of its ``best`` highest scores (DeepSeek-V3: 1, the max; 2 with a routing bias);
    ties go to the lower group."""
    e = choose.shape[-1]
    grouped = choose.reshape(*choose.shape[:-1], groups, e // groups)
    score = jnp.sum(jax.lax.top_k(grouped, min(best, e // groups))[0], axis=-1)
    _, top = jax.lax.top_k(score, group_limit)  # (..., group_limit)
    chosen = jnp.any(jax.nn.one_hot(top, groups, dtype=jnp.bool_), axis=-2)  # (..., groups)
    mask = jnp.repeat(chosen, e // groups, axis=-1)
    return jnp.where(mask, choose, -jnp.inf)


def check_groups(
    api: str, groups: int | None, group_limit: int | None, num_experts: int, k: int
) -> None:
    """Raise ValueError (TypeError for a non-int) for node-limited routing arguments
    :func:`~jaxcoll.parallel.moe_mlp` refuses: both or neither, ``groups`` dividing ``E``,
    ``1 <= group_limit <= groups`` and room for ``k`` experts in ``group_limit`` groups."""
    if groups is None and group_limit is None:
        return
    if groups is None or group_limit is None:
        raise ValueError(
            f"{api}: groups={groups!r}, group_limit={group_limit!r}; node-limited routing "
            f"takes both (the expert groups, and how many of them each token may use), or "
            f"neither."
        )
    for name, v in (("groups", groups), ("group_limit", group_limit)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{api}: {name} must be an int, got {v!r} instead.")
    if groups < 1 or num_experts % groups:
        raise ValueError(
            f"{api}: groups={groups} must divide num_experts={num_experts} (contiguous groups "
            f"of equal size, e.g. one per node); pass a divisor of {num_experts}."
        )
    if not 1 <= group_limit <= groups:
        raise ValueError(
            f"{api}: group_limit={group_limit}; pass 1 <= group_limit <= groups={groups}."
        )
    if k > group_limit * (num_experts // groups):
        raise ValueError(
            f"{api}: k={k} experts per token do not fit in group_limit={group_limit} groups "
            f"of {num_experts // groups} experts; raise group_limit or lower k."
        )
