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
) -> Routes:
    """Top-``k`` routing of ``logits`` ``(B, S, E)``: each token's ``k`` best experts.

    ``scores = softmax(logits)`` (or ``sigmoid``); the gates are the chosen experts' scores,
    divided by their sum when ``normalize``. With a ``capacity``, expert ``e`` keeps at most
    ``capacity`` assignments per sequence, taken in GShard's order: the first choices of the
    sequence's tokens in position order, then the second choices, ...; the rest are dropped
    (the token goes on without that expert's output). The arguments are those
    :func:`~jaxcoll.parallel.moe_mlp` checked.
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
