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
from ..._core.vma import axis_names, cast_varying, types_tracked, varying_axes
from ..axes import is_bound
from ..tensor import gelu
from .experts import check_buffer_factor, run_experts
from .hierarchical import hierarchical_experts
from .metrics import Load, load
from .router import SCORE_FUNCS, capacity_of, check_groups, route


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
    bias: jax.Array | None = None,
    tensor_axis_name: AxisName | None = None,
    groups: int | None = None,
    group_limit: int | None = None,
    hierarchical: bool = False,
    buffer_factor: float | None = None,
) -> tuple[jax.Array, Load]:
    """A mixture-of-experts MLP on ``x`` ``(B, S, d)``, its experts split over ``axis_name``.

    Equivalent to, on one device with every expert::

        scores = softmax(x @ router)                  # or sigmoid; (B, S, E)
        gate, e = top_k(scores, k)                    # gate / sum(gate) when normalize
        # with a bias: e = top_k(scores + bias, k), gate = scores[e] (unbiased)
        # with groups: e only in each token's group_limit best groups, gate = scores[e]
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

    With ``tensor_axis_name`` bound too (t devices; expert tensor parallel), each expert's
    hidden units are split over it as a Megatron MLP's are: ``w_in`` ``(E/n, d, h/t)`` and
    ``w_out`` ``(E/n, h/t, d)`` are this device's slices of its experts. ``x`` and ``router``
    must be the same on every device of the tensor axis (gather sequence-parallel rows
    first; a ``router`` that varies over it is refused), so each routes and exchanges the same
    tokens, computes its slice's partial outputs, and ONE all-reduce over the tensor axis
    sums them, on ``y`` ``(B, S, d)`` (after the gates: ``k`` times fewer rows than the
    exchanged assignments); the backward sums the tokens' cotangent once, likewise on
    ``(B, S, d)``.

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
        bias: None, or ``(E,)``: a routing bias for choosing the experts only (DeepSeek-V3's
            auxiliary-loss-free load balancing): each token's experts are the top ``k`` of
            ``scores + bias``, their gates still the unbiased ``scores``; it gets no
            gradient. Keep it outside the params and step it after each step with
            :func:`~jaxcoll.parallel.moe.metrics.update_expert_bias` of the returned load
            (:class:`jaxcoll.nn.MoE` does, given a ``bias_update_rate``).
        tensor_axis_name: the axis the experts' hidden units are split over (a role:
            ``"tensor"`` inside a ``dp.Trainer``); None (the default) or not bound: each
            device holds its experts' whole kernels.
        groups: node-limited routing (DeepSeek-V3's ``n_group``): the ``E`` experts as
            ``groups`` contiguous groups (one per node: ``groups`` = the outer axis's size);
            with ``group_limit``, each token chooses its experts in the ``group_limit``
            groups of best score only (a group's score: its best expert's score, the sum of
            its two best with a ``bias``). None (the default): no limit.
        group_limit: the groups each token may use (DeepSeek-V3's ``topk_group``, its M
            nodes), ``1 <= group_limit <= groups``, room for ``k`` experts; with ``groups``.
        hierarchical: with ``axis_name`` a pair ``(outer, inner)`` of mesh axes (across
            processes, within one; expert ``e`` on device ``e // (E/n)`` row-major over the
            pair), the two-level exchange (:mod:`jaxcoll.parallel.moe.hierarchical`): each
            token crosses ``outer`` once per node holding some of its experts, then goes to
            its experts' devices over ``inner``; their gated outputs are summed on the node
            and one row per (token, node) returns. Equal to the flat exchange (the default,
            False) in value and gradient, with fewer bytes across processes.
        buffer_factor: dropless at bounded memory (with ``capacity_factor=None``, the flat
            exchange): None (the default) gives each device a receive buffer with room for
            every assignment of every device (``n * T * k`` rows); a positive number sizes
            it ``factor`` times the balanced load (``n * ceil(factor * T * k / n)`` rows, as
            a capacity's buffer) and sends what does not fit in further rounds through it
            (each sender at most ``ceil(factor * T * k / n)`` rows to each device a round),
            dropping nothing whatever the routing: the rounds an all-to-one routing needs
            are ``ceil(n / factor)``; a round not needed costs nothing but a branch.

    Returns:
        ``(y, load)``: ``y`` like ``x``, and the :class:`~jaxcoll.parallel.Load` of the
        whole batch (:func:`~jaxcoll.parallel.moe_metrics` reads it).

    Raises:
        ValueError: at trace time, for an ``x`` that is not ``(B, S, d)``, ``k`` outside
            ``1..E``, an unknown ``score_func``, a ``capacity_factor`` that is not a
            positive number or None (or one under context parallel), a ``buffer_factor``
            that is not a positive number or None (or one beside a ``capacity_factor`` or
            ``hierarchical``), a ``w_in`` that does
            not hold ``E / n`` experts, or a ``bias`` that is not ``(E,)``; with a bound
            ``tensor_axis_name``: the expert axis itself, a ``router`` that varies over it,
            or a kernel that is whole over it (the same on every device).
    """
    return run_moe_mlp(
        "parallel.moe_mlp", x, router, w_in, w_out, k=k, axis_name=axis_name,
        data_axis_name=data_axis_name, score_func=score_func, normalize=normalize,
        capacity_factor=capacity_factor, activation=activation, bias=bias,
        tensor_axis_name=tensor_axis_name, groups=groups, group_limit=group_limit,
        hierarchical=hierarchical, buffer_factor=buffer_factor,
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
    bias: jax.Array | None = None,
    tensor_axis_name: AxisName | None = None,
    groups: int | None = None,
    group_limit: int | None = None,
    hierarchical: bool = False,
    buffer_factor: float | None = None,
) -> tuple[jax.Array, Load]:
    """:func:`moe_mlp`, its errors naming ``api`` (the function, or the layer
    :class:`jaxcoll.nn.MoE` that calls it): the argument checks, then the computation."""
    axis_name = _bound(axis_name)
    n = 1 if axis_name is None else primitives.world_size(axis_name)
    k = _check(api, x, router, w_in, k, score_func, capacity_factor, n)
    check_buffer_factor(api, buffer_factor, capacity_factor, hierarchical)
    tensor = _tensor_axis(api, tensor_axis_name, axis_name, x, router, w_in, w_out)
    b, s, d = x.shape
    num_experts = router.shape[-1]
    logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), router.astype(jnp.float32))
    capacity = capacity_of(s, k, num_experts, capacity_factor)
    _check_bias(api, bias, num_experts)
    check_groups(api, groups, group_limit, num_experts, k)
    routes = route(
        logits, k, score_func=score_func, normalize=normalize, capacity=capacity, bias=bias,
        groups=groups, group_limit=group_limit,
    )  # fmt: skip
    stats = load(routes, num_experts, _bound(data_axis_name))
    if hierarchical and axis_name is not None:  # the two-level exchange (.hierarchical)
        y = hierarchical_experts(
            api, _rows(x.reshape(b * s, d), tensor), routes.expert.reshape(b * s, k),
            (routes.gate * routes.keep).astype(x.dtype).reshape(b * s, k),
            routes.keep.reshape(b * s, k), w_in, w_out, activation=activation,
            axis_name=axis_name, per_expert=None if capacity is None else b * capacity,
        )  # fmt: skip
        if tensor is not None:
            y = primitives.all_reduce(y, tensor)
        return y.reshape(b, s, d).astype(x.dtype), stats

    rows = jnp.repeat(_rows(x.reshape(b * s, d), tensor), k, axis=0)  # (T*k, d): token-major
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
        buffer_factor=buffer_factor,
    )
    weights = (routes.gate * routes.keep).astype(out.dtype).reshape(-1, 1)
    y = jnp.sum((out * weights).reshape(b * s, k, d), axis=1)
    if tensor is not None:  # each tensor rank's partial outputs (its hidden slice), summed once
        y = primitives.all_reduce(y, tensor)
    return y.reshape(b, s, d).astype(x.dtype), stats


def _bound(axis_name: AxisName | None) -> AxisName | None:
    """The mesh axis ``axis_name`` (a role: the layout's axis for it) where it is bound, else
    None."""
    axis_name = roles.axis(axis_name)
    return axis_name if axis_name is not None and is_bound(axis_name) else None


def _rows(x: jax.Array, tensor: AxisName | None) -> jax.Array:
    """The tokens ``(T, d)`` the experts take, typed varying over the bound ``tensor`` axis
    (they meet each rank's hidden slice there): the backward then sums their cotangents over
    it once, on ``(T, d)``, not on the ``k`` times as many rows the exchange moves."""
    return x if tensor is None else cast_varying(x, axis_names(tensor))


def _tensor_axis(
    api: str,
    tensor_axis_name: AxisName | None,
    axis_name: AxisName | None,
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
) -> AxisName | None:
    """The bound tensor axis the experts' hidden units are split over, or None; raise
    ValueError where it is the expert axis, where ``router`` varies over it (each rank would
    route differently) or where a kernel is whole over it (the sum of the partial outputs
    would count it once per rank). ``x`` is not checked: a pipeline's activations are typed
    varying over every axis though equal over the tensor axis; it must be equal there."""
    tensor = _bound(tensor_axis_name)
    if tensor is None:
        return None
    names = axis_names(tensor)
    if axis_name is not None and set(names) & set(axis_names(axis_name)):
        raise ValueError(
            f"{api}: tensor_axis_name={tensor!r} is also the expert axis ({axis_name!r}); "
            f"split the experts' hidden units over another axis, or pass tensor_axis_name=None."
        )
    if not types_tracked(names):  # check_vma off: no types to read
        return tensor
    if set(names) & set(varying_axes(router) or ()):
        raise ValueError(
            f"{api}: router varies over the tensor axis {tensor!r}, over which the experts' "
            f"hidden units are split: each rank would route the tokens its own way and the "
            f"sum of the partial outputs would mix them. Pass the router the same on every "
            f"device of {tensor!r} (replicated), or tensor_axis_name=None."
        )
    for argname, value in (("w_in", w_in), ("w_out", w_out)):
        if not set(names) <= set(varying_axes(value) or ()):
            raise ValueError(
                f"{api}: {argname} is the same on every device of the tensor axis {tensor!r} "
                f"(the kernels are whole there, not this device's slice of the hidden units), "
                f"so summing the partial outputs over {tensor!r} would count them once per "
                f"device. Pass each device its slice (w_in split over {tensor!r} along dim 2, "
                f"w_out along dim 1: jaxcoll.nn.MoE declares them so), or "
                f"tensor_axis_name=None."
            )
    return tensor


def _check_bias(api: str, bias: jax.Array | None, num_experts: int) -> None:
    """Raise ValueError for a routing ``bias`` that is not ``(num_experts,)`` floats."""
    if bias is None:
        return
    if jnp.shape(bias) != (num_experts,) or not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
        raise ValueError(
            f"{api}: bias has shape {jnp.shape(bias)} and dtype {jnp.result_type(bias)}; pass "
            f"one float per expert, ({num_experts},) (the router's columns), or None."
        )


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
