"""Two-level MoE dispatch: the expert axis split in two mesh axes, ``(outer, inner)`` (across
processes or nodes, and within one node's devices), so that a token bound for several experts
on one node crosses the slow link once.

:func:`hierarchical_dispatch` sends each token once to every node that holds one of its
experts (over ``outer``, to the device of that node at the sender's own ``inner`` position:
one message per destination node, whatever the number of its experts there), with the
token's expert ids and gates; :func:`hierarchical_experts` then spreads each received token's
assignments over the node's devices (over ``inner``, :func:`~jaxcoll.parallel.moe.experts.
run_experts`), weighs the outputs by their gates and sums them per token, and
:func:`hierarchical_combine` sends that one partial sum per (token, node) back over
``outer`` and adds the nodes' parts. Equal in value and gradient to the flat exchange over
the whole expert axis (:func:`~jaxcoll.parallel.dispatch`), up to the order of the sums.

DeepSeek-V3 pairs this with node-limited routing (each token's experts on at most M nodes,
:func:`jaxcoll.parallel.moe_mlp`'s ``groups`` and ``group_limit``): then at most M copies of a
token cross between nodes, where a flat exchange sends one per assignment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ... import primitives
from ..._core.typing import AxisName
from .exchange import Routing, combine, dispatch
from .experts import run_experts


class NodeRouting(NamedTuple):
    """What :func:`hierarchical_combine` needs: the outer exchange's routing and the tokens'
    count."""

    outer: Routing  # the exchange of (token, node) pairs over the outer axis
    tokens: int  # this device's tokens, T (static)


def check_axes(api: str, axis_name: AxisName) -> tuple[AxisName, AxisName]:
    """``axis_name`` as the pair ``(outer, inner)`` of mesh axes, or ValueError naming
    ``api``."""
    if not (isinstance(axis_name, (tuple, list)) and len(axis_name) == 2):
        raise ValueError(
            f"{api}: hierarchical=True needs the expert axis as a pair of mesh axes, "
            f"(outer, inner): across nodes (processes), then within one; got "
            f"axis_name={axis_name!r}. Pass e.g. axis_name=('node', 'local')."
        )
    return axis_name[0], axis_name[1]


def hierarchical_dispatch(
    x: jax.Array,
    expert: jax.Array,
    weight: jax.Array,
    axis_name: AxisName,
    *,
    experts_per_rank: int,
    keep: jax.Array | None = None,
    max_per_node: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, NodeRouting]:
    """Send each token once to every node holding one of its kept experts.

    ``axis_name = (outer, inner)``, ``P`` and ``L`` devices: expert ``e`` lives on device
    ``e // experts_per_rank`` of the expert axis (row-major over the pair), so on node
    ``e // (experts_per_rank * L)``. Equivalent to::

        for each token t, each node p with some kept e = expert[t, j] on p:
            send (x[t], [e % (experts_per_rank * L) if on p else none for e in expert[t]],
                  weight[t]) to device (p, my inner position)

    Lowering: one :func:`~jaxcoll.parallel.dispatch` over ``outer`` of the ``(token, node)``
    pairs (the token, its ids and gates in one transfer): ``P * T`` candidate rows, each
    receiver packs what it gets into ``P * max_per_node`` rows.

    Args:
        x: this device's tokens, ``(T, d)``.
        expert: ``(T, k)`` int, each token's experts (global ids).
        weight: ``(T, k)``, the gates the outputs are summed with (they travel with the token).
        axis_name: the expert axis as ``(outer, inner)`` mesh axes.
        experts_per_rank: experts held by each device (static).
        keep: ``(T, k)`` bool, the assignments to compute (None: all).
        max_per_node: the most tokens this device sends to any one node (None: ``T``).

    Returns:
        ``(tokens, local_expert, weight, valid, routing)``: the received tokens
        ``(P * max_per_node, d)``, their ``k`` expert ids within this node (``E_node`` where
        the assignment is not on this node or not kept), their gates, a bool mask of the real
        rows, and the :class:`NodeRouting` for :func:`hierarchical_combine`.
    """
    outer, inner = check_axes("hierarchical_dispatch", axis_name)
    p = primitives.world_size(outer)
    per_node = experts_per_rank * primitives.world_size(inner)
    t = x.shape[0]
    keep = jnp.ones(expert.shape, bool) if keep is None else keep
    nodes = jnp.arange(p, dtype=jnp.int32)[:, None, None]
    here = keep[None] & (expert[None] // per_node == nodes)  # (P, T, k): kept, on node p
    ids = jnp.where(here, expert[None] % per_node, per_node)  # node-local ids, or none
    pairs = {  # node-major (token, node) pairs: pair p * T + t
        "x": jnp.broadcast_to(x[None], (p, *x.shape)).reshape(p * t, *x.shape[1:]),
        "e": ids.reshape(p * t, -1).astype(jnp.int32),
        "w": jnp.broadcast_to(weight[None], (p, *weight.shape)).reshape(p * t, -1),
    }
    dest = jnp.repeat(jnp.arange(p, dtype=jnp.int32), t)
    rows = t if max_per_node is None else min(t, max_per_node)
    got, _, valid, routing = dispatch(
        pairs,
        dest,
        outer,
        experts_per_rank=1,
        capacity=p * rows,
        keep=jnp.any(here, axis=-1).reshape(-1),
        max_per_rank=rows,
    )
    return got["x"], got["e"], got["w"], valid, NodeRouting(routing, t)


def hierarchical_combine(y: jax.Array, routing: NodeRouting, axis_name: AxisName) -> jax.Array:
    """Send each received token's partial output (``y``, rows as
    :func:`hierarchical_dispatch` delivered them) back to its device and add the nodes' parts.

    Equivalent to ``out[t] = sum(y_on_node_p[row of (t, p)] for p with t's experts)``;
    lowering: one ragged all-to-all over ``outer`` by the dispatch's own plan, reversed
    (:func:`~jaxcoll.parallel.combine`), and a sum over the ``P`` nodes. Differentiable in
    ``y``.

    Args:
        y: ``(P * max_per_node, d)``, each received token's output from this node's experts.
        routing: from :func:`hierarchical_dispatch`.
        axis_name: the expert axis as ``(outer, inner)`` mesh axes.

    Returns:
        ``(T, d)``, in this device's token order (zeros for a token with no kept expert).
    """
    outer, _ = check_axes("hierarchical_combine", axis_name)
    back = combine(y, routing.outer, outer)  # (P * T, d), pair order
    return jnp.sum(back.reshape(-1, routing.tokens, *back.shape[1:]), axis=0)


def hierarchical_experts(
    api: str,
    x: jax.Array,
    expert: jax.Array,
    weight: jax.Array,
    keep: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    axis_name: AxisName,
    per_expert: int | None,
) -> jax.Array:
    """``y[t] = sum_j weight[t, j] * ffn(expert[t, j], x[t])`` over the kept assignments,
    the experts split over ``axis_name = (outer, inner)`` and reached by the two-level
    exchange: :func:`hierarchical_dispatch` over ``outer``, :func:`~jaxcoll.parallel.moe.
    experts.run_experts` over ``inner`` (each assignment to its device in the node, and
    back), the gates' sum per token on the node, :func:`hierarchical_combine` over ``outer``.

    Args:
        api: the caller, named in errors.
        x: ``(T, d)``, this device's tokens.
        expert: ``(T, k)`` int, global expert ids.
        weight: ``(T, k)``, the gates (zero where not kept), in ``x``'s dtype.
        keep: ``(T, k)`` bool, the assignments to compute.
        w_in: this device's experts' first kernels, ``(E_local, d, h)``.
        w_out: their second kernels, ``(E_local, h, d)``.
        activation: the experts' nonlinearity.
        axis_name: the bound expert axis as ``(outer, inner)`` mesh axes.
        per_expert: the most assignments this device's tokens give one expert (a capacity's
            ``B * capacity``), or None (dropless): it bounds the exchanges' buffers.

    Returns:
        ``(T, d)``, in ``x``'s dtype.
    """
    outer, inner = check_axes(api, axis_name)
    p, n_in = primitives.world_size(outer), primitives.world_size(inner)
    t, k = expert.shape
    local = w_in.shape[0]
    to_node = t if per_expert is None else min(t, per_expert * local * n_in)
    rows, ids, gates, valid, routing = hierarchical_dispatch(
        x, expert, weight, axis_name, experts_per_rank=local, keep=keep, max_per_node=to_node
    )
    c = rows.shape[0]  # P * to_node received tokens
    node_experts = local * n_in
    ok = (ids < node_experts) & valid[:, None]  # (c, k): assignments on this node
    to_device = c * min(k, local)  # a token's distinct experts on one device: <= min(k, local)
    if per_expert is not None:
        to_device = min(to_device, p * per_expert * local)
    out = run_experts(
        jnp.repeat(rows, k, axis=0),
        jnp.where(ok, ids, 0).reshape(-1),
        ok.reshape(-1),
        w_in,
        w_out,
        activation=activation,
        axis_name=inner,
        max_per_rank=to_device,
    )
    part = jnp.sum(out.reshape(c, k, -1) * gates[..., None].astype(out.dtype), axis=1)
    return hierarchical_combine(part, routing, axis_name).astype(x.dtype)
