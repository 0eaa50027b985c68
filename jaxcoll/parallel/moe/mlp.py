"""The mixture-of-experts MLP, the one functional entry: :func:`moe_mlp` checks its
arguments, routes the tokens (:mod:`.router`), runs the experts where they live
(:mod:`.experts`, over :mod:`.exchange`) and counts the load (:mod:`.metrics`).

:class:`jaxcoll.nn.MoE`, the flax layer, declares the params and makes one call here
(:func:`run_moe_mlp`, which names the layer in its errors), so the layer and the function
refuse the same inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ... import primitives
from ..._core import roles
from ..._core.checks import check_static_int
from ..._core.roles import Role
from ..._core.typing import AxisName
from ..axes import is_bound
from ..tensor import gelu
from .experts import run_experts
from .metrics import Load, load
from .router import SCORE_FUNCS, capacity_of, route


def moe_mlp(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    k: int,
    axis_name: AxisName | None = Role.EXPERT,
    data_axis_name: AxisName | None = None,
    score_func: str = "softmax",
    normalize: bool = False,
    capacity_factor: float | None = None,
    activation: Callable[[jax.Array], jax.Array] = gelu,
) -> tuple[jax.Array, Load]:
    """A mixture-of-experts MLP on ``x`` ``(B, S, d)``, its experts split over ``axis_name``.

    Equivalent to, on one device with every expert::

        scores = softmax(x @ router)                  # or sigmoid; (B, S, E)
        gate, e = top_k(scores, k)                    # gate / sum(gate) when normalize
        y[t] = sum(gate[t, j] * ffn(e[t, j], x[t])
                   for j in range(k) if kept(t, j))   # kept: within the capacity
        ffn(e, v) = activation(v @ w_in[e]) @ w_out[e]

    With ``capacity_factor=None`` (dropless) every assignment is kept; with a factor, each
    expert keeps ``ceil(factor * S * k / E)`` assignments per sequence, taken in GShard's
    order: the first choices of the sequence's tokens in position order, then the second
    choices, ...; the rest are dropped (the token goes on without that expert's output). A
    token's fate depends on its own sequence only, in any layout.

    Under ``jax.shard_map`` with ``axis_name`` bound (n devices), ``w_in`` ``(E/n, d, h)``
    and ``w_out`` ``(E/n, h, d)`` are this device's experts (expert ``e`` on rank
    ``e // (E/n)``) and ``x`` this device's tokens: the kept assignments travel to their
    experts by one ragged all-to-all (:func:`~jaxcoll.parallel.dispatch`; dropless: room for
    every assignment of every rank), the outputs come back by another
    (:func:`~jaxcoll.parallel.combine`); the backward is the same two, reversed. Each
    all-to-all settles its sizes by one small exchange of counts (``n * n`` int32). Where
    ``axis_name`` is not bound every expert is local and nothing travels.

    Args:
        x: the tokens, ``(B, S, d)``: a batch of sequences.
        router: ``(d, E)``, the router's kernel (its logits are computed in float32).
        w_in: the local experts' first kernels, ``(E_local, d, h)``.
        w_out: their second kernels, ``(E_local, h, d)``.
        k: experts per token, ``1 <= k <= E``.
        axis_name: the expert axis (default the role ``"expert"``: inside a ``dp.Trainer``
            the layout's expert axis); not bound: every expert is local.
        data_axis_name: the axes the batch's tokens are split over, for the load and the
            auxiliary loss over the whole batch (the role ``"batch"`` inside a Trainer);
            None or not bound: this device's tokens.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        normalize: divide the gates by their sum (DeepSeek's sigmoid routing does).
        capacity_factor: None: dropless; else a positive number: each expert keeps
            ``ceil(factor * S * k / E)`` assignments per sequence. Not with context parallel
            (its axis splits every sequence).
        activation: the experts' nonlinearity (torch's exact ``nn.GELU()``).

    Returns:
        ``(y, load)``: ``y`` like ``x``, and the :class:`~jaxcoll.parallel.Load` of the
        whole batch (:func:`~jaxcoll.parallel.moe_metrics` reads it).

    Raises:
        ValueError: at trace time, for an ``x`` that is not ``(B, S, d)``, ``k`` outside
            ``1..E``, an unknown ``score_func``, a ``capacity_factor`` that is not a
            positive number or None (or one under context parallel), or a ``w_in`` that does
            not hold ``E / n`` experts.
    """
    return run_moe_mlp(
        "parallel.moe_mlp", x, router, w_in, w_out, k=k, axis_name=axis_name,
        data_axis_name=data_axis_name, score_func=score_func, normalize=normalize,
        capacity_factor=capacity_factor, activation=activation,
    )  # fmt: skip


def run_moe_mlp(
    api: str,
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    k: int,
    axis_name: AxisName | None,
    data_axis_name: AxisName | None,
    score_func: str,
    normalize: bool,
    capacity_factor: float | None,
    activation: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, Load]:
    """:func:`moe_mlp`, its errors naming ``api`` (the function, or the layer
    :class:`jaxcoll.nn.MoE` that calls it): the argument checks, then the computation."""
    axis_name = _bound(axis_name)
    n = 1 if axis_name is None else primitives.world_size(axis_name)
    k = _check(api, x, router, w_in, k, score_func, capacity_factor, n)
    b, s, d = x.shape
    num_experts = router.shape[-1]
    logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), router.astype(jnp.float32))
    capacity = capacity_of(s, k, num_experts, capacity_factor)
    routes = route(logits, k, score_func=score_func, normalize=normalize, capacity=capacity)
    stats = load(routes, num_experts, _bound(data_axis_name))

    rows = jnp.repeat(x.reshape(b * s, d), k, axis=0)  # (T*k, d): token-major, then slot
    bound_rows = None if capacity is None else min(b * s * k, b * capacity * w_in.shape[0])
    out = run_experts(
        rows,
        routes.expert.reshape(-1),
        routes.keep.reshape(-1),
        w_in,
        w_out,
        activation=activation,
        axis_name=axis_name,
        max_per_rank=bound_rows,
    )
    weights = (routes.gate * routes.keep).astype(out.dtype).reshape(-1, 1)
    y = jnp.sum((out * weights).reshape(b * s, k, d), axis=1)
    return y.reshape(b, s, d).astype(x.dtype), stats


def _bound(axis_name: AxisName | None) -> AxisName | None:
    """The mesh axis ``axis_name`` (a role: the layout's axis for it) where it is bound, else
    None."""
    axis_name = roles.axis(axis_name)
    return axis_name if axis_name is not None and is_bound(axis_name) else None


def _check(
    api: str,
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    k: int,
    score_func: str,
    capacity_factor: float | None,
    n: int,
) -> int:
    """Raise ValueError (TypeError for a ``k`` not an int) for arguments :func:`moe_mlp`
    refuses; return ``k``."""
    if jnp.ndim(x) != 3:
        raise ValueError(
            f"{api}: x has shape {jnp.shape(x)}; pass a batch of sequences, "
            f"(batch, length, features)."
        )
    num_experts = router.shape[-1]
    k = check_static_int(api, "k", k)
    if not 1 <= k <= num_experts:
        raise ValueError(
            f"{api}: k={k} experts per token, of num_experts={num_experts} (the router's "
            f"columns); pass 1 <= k <= {num_experts}."
        )
    if score_func not in SCORE_FUNCS:
        raise ValueError(
            f"{api}: score_func={score_func!r} is not a score function; pass one of {SCORE_FUNCS}."
        )
    cf = capacity_factor
    number = isinstance(cf, (int, float, np.integer, np.floating)) and not isinstance(cf, bool)
    if cf is not None and not (number and math.isfinite(cf) and cf > 0):
        raise ValueError(
            f"{api}: capacity_factor={cf!r} must be a positive number (each expert keeps "
            f"ceil(factor * S * k / E) assignments per sequence), or None (dropless)."
        )
    local = w_in.shape[0]
    if local * n != num_experts:
        raise ValueError(
            f"{api}: w_in holds {local} experts on each of {n} devices, and the router "
            f"scores {num_experts}; give each device num_experts / n experts."
        )
    if cf is not None and (context := _bound(Role.CONTEXT)) is not None:
        raise ValueError(
            f"{api}: capacity_factor={cf} counts each expert's assignments per sequence, and "
            f"the context axis '{context}' splits every sequence; use the dropless layer "
            f"(capacity_factor=None) with context parallel."
        )
    return k
