"""The load of a mixture of experts over the whole batch, its load-balancing loss, and the
step's metrics read from the loads a model returned or sowed."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ... import primitives
from ..._core.typing import AxisName, PyTree
from .router import Routes


class Load(NamedTuple):
    """The load of one mixture of experts over the whole batch (summed over the data axes):
    what :func:`~jaxcoll.parallel.moe_mlp` returns, :class:`jaxcoll.nn.MoE` sows and
    :func:`~jaxcoll.parallel.moe_metrics` reads."""

    routed: jax.Array  # (E,) assignments each expert was chosen for
    kept: jax.Array  # (E,) of those, the ones processed (within the capacity)
    aux: jax.Array  # the load-balancing loss, E * sum_e f_e P_e (Switch Transformer)


def load(routes: Routes, num_experts: int, data_axis_name: AxisName | None) -> Load:
    """The load of ``routes`` over every token of the batch: summed over
    ``data_axis_name`` (the axes the tokens are split over; None: this device's tokens)."""
    onehot = jax.nn.one_hot(routes.expert, num_experts, dtype=jnp.float32)  # (..., k, E)
    routed = jnp.sum(onehot, axis=tuple(range(onehot.ndim - 1)))
    kept = jnp.sum(onehot * routes.keep[..., None], axis=tuple(range(onehot.ndim - 1)))
    probs = jnp.sum(routes.scores.astype(jnp.float32), axis=tuple(range(routes.scores.ndim - 1)))
    tokens = jnp.asarray(math.prod(routes.expert.shape[:-1]), jnp.float32)
    if data_axis_name is not None:  # one all-reduce of the four, side by side
        e = num_experts
        both = primitives.all_reduce(
            jnp.concatenate([routed, kept, probs, tokens[None]]), data_axis_name
        )
        routed, kept, probs, tokens = both[:e], both[e : 2 * e], both[2 * e : 3 * e], both[3 * e]
    k = routes.expert.shape[-1]
    fraction = routed / (tokens * k)  # f_e: the share of assignments routed to e
    aux = num_experts * jnp.sum(fraction * probs / tokens)
    return Load(routed, kept, aux)


def moe_metrics(loads: PyTree) -> dict[str, jax.Array]:
    """The step's metrics of its mixtures of experts, from every :class:`Load` in ``loads``.

    ``loads`` is any pytree holding them: the ``"intermediates"`` a model's apply sowed
    (:class:`jaxcoll.nn.MoE` sows its load there: apply the model with
    ``mutable=["intermediates"]``), or the loads :func:`~jaxcoll.parallel.moe_mlp` returned.

    Args:
        loads: a pytree whose :class:`Load` leaves are the step's layers' loads (other
            leaves are ignored).

    Returns:
        ``{}`` when it holds no load; else ``moe_aux`` (the load-balancing losses summed
        over the layers: add ``aux_weight * moe_aux`` to the loss), ``moe_dropped`` (the
        share of assignments over the capacity) and ``moe_imbalance`` (the busiest expert's
        assignments over the mean, in the worst layer), each over the whole batch.
    """
    leaves = jax.tree_util.tree_leaves(loads, is_leaf=lambda v: isinstance(v, Load))
    found = [v for v in leaves if isinstance(v, Load)]
    if not found:
        return {}
    routed = jnp.sum(jnp.stack([jnp.sum(x.routed) for x in found]))
    kept = jnp.sum(jnp.stack([jnp.sum(x.kept) for x in found]))
    imbalance = jnp.max(jnp.stack([jnp.max(x.routed) / jnp.mean(x.routed) for x in found]))
    return {
        "moe_aux": jnp.sum(jnp.stack([x.aux for x in found])),
        "moe_dropped": 1.0 - kept / routed,
        "moe_imbalance": imbalance,
    }


def update_expert_bias(bias: jax.Array, load: Load, rate: float) -> jax.Array:
    """The routing bias after a step of DeepSeek-V3's auxiliary-loss-free load balancing.

    Equivalent to::

        bias + rate * sign(mean(load.routed) - load.routed)

    each expert's bias raised by ``rate`` where it was chosen for fewer assignments than the
    mean, lowered where for more (unchanged at the mean), outside the gradient
    (``stop_gradient``). ``load`` is over the whole batch (summed over the data axes), so every
    device, in any layout, computes the same new bias. The bias enters the routing through
    :func:`~jaxcoll.parallel.moe_mlp`'s ``bias``: it chooses the experts, never weighs them.

    Args:
        bias: ``(E,)``, the bias the step routed with.
        load: the step's :class:`Load` (what :func:`~jaxcoll.parallel.moe_mlp` returned).
        rate: the update's size per step (DeepSeek-V3's gamma, 0.001 there).

    Returns:
        The new bias, ``(E,)``, in ``bias``'s dtype.
    """
    routed = jax.lax.stop_gradient(load.routed).astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(routed) - routed)
    return (jax.lax.stop_gradient(bias) + step).astype(jnp.result_type(bias))
