"""The tokens' exchange of expert parallelism: to the experts' ranks and back (MoE dispatch
and combine).

The form MoE layers use: each rank's tokens are sorted by destination, a ragged all_to_all
(:func:`jaxcoll.primitives.ragged_all_to_all`, torch's ``all_to_all_single`` with split
sizes) delivers them into a static-capacity buffer, and the reverse exchange returns the
experts' outputs to where each token came from.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ... import primitives
from ..._core.typing import AxisName, PyTree
from ...primitives._ragged import ragged_exchange, ragged_return


class Routing(NamedTuple):
    """What :func:`combine` needs to send outputs back: the sort and both size vectors."""

    order: jax.Array  # (T,) token indices sorted by destination rank
    send_sizes: jax.Array  # (n,) tokens this rank sent to each rank
    recv_sizes: jax.Array  # (n,) tokens this rank kept from each rank
    plan: tuple[jax.Array, ...]  # the exchange's offsets, to send the rows back
    rows: int | None = None  # the most rows sent to any one rank (static), or None


def dispatch(
    x: PyTree,
    expert: jax.Array,
    axis_name: AxisName,
    *,
    experts_per_rank: int,
    capacity: int | None = None,
    keep: jax.Array | None = None,
    max_per_rank: int | None = None,
    start: int | jax.Array = 0,
) -> tuple[PyTree, jax.Array, jax.Array, Routing]:
    """Send each token to the rank holding its expert; return what this rank's experts get.

    Expert ``e`` lives on rank ``e // experts_per_rank`` as local expert
    ``e % experts_per_rank``. Equivalent to::

        def dispatch(x, expert, axis_name, experts_per_rank, capacity):
            received = [tok for j in ranks for tok, e in tokens_of_rank(j)
                        if e // experts_per_rank == rank(axis_name)]   # sender order, then
            return pad(received, capacity), local_ids, valid, routing   # token order

    Lowering: a stable ``argsort`` by destination, one
    :func:`~jaxcoll.primitives.ragged_all_to_all` of the tokens and their local expert ids
    (one transfer for the pytree).

    Args:
        x: this rank's tokens ``(T, ...)`` (or a pytree of leaves with T rows).
        expert: ``(T,)`` int expert id of each token, ``0 <= e < n * experts_per_rank``.
        axis_name: the expert-parallel mesh axis.
        experts_per_rank: experts held by each rank (static).
        capacity: rows this rank can receive; default ``n * T`` (no token is ever dropped).
            Tokens past it are dropped and come back from :func:`combine` as zeros.
        keep: ``(T,)`` bool, the tokens to send (None: all); the others are not sent and
            come back from :func:`combine` as zeros (a capacity the router applied).
        max_per_rank: the most tokens sent to any one rank (None: no bound): past it, a
            rank's tokens are not sent (zeros from :func:`combine`). A router's capacity
            gives it; where XLA has no ragged all-to-all (CPU) the exchange then moves
            ``n * max_per_rank`` rows per rank instead of ``n * T``.
        start: with ``max_per_rank``, the tokens to each rank already sent (an int, traced
            or not): a rank's tokens ``start .. start + max_per_rank - 1`` (in token order)
            are sent, the others not. Sending every token in rounds of ``max_per_rank``
            (``start = round * max_per_rank``) bounds the buffers and drops nothing
            (:func:`jaxcoll.parallel.moe_mlp`'s ``buffer_factor``).

    Returns:
        ``(tokens, local_expert, valid, routing)``: the received tokens ``(capacity, ...)``,
        their local expert ids, a bool mask of the real rows, and the :class:`Routing` for
        :func:`combine`.
    """
    n = primitives.world_size(axis_name)
    t = jax.tree_util.tree_leaves(x)[0].shape[0]
    cap = n * t if capacity is None else capacity
    dest = expert // experts_per_rank
    if keep is not None:  # not sent: sorted past every rank's rows, counted nowhere
        dest = jnp.where(keep, dest, n)
    if max_per_rank is not None:  # each rank's tokens start.., max_per_rank, in token order
        onehot = jax.nn.one_hot(dest, n + 1, dtype=jnp.int32)
        ahead = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
        window = (ahead >= start) & (ahead < start + max_per_rank)
        dest = jnp.where(window, dest, n)
    order = jnp.argsort(dest, stable=True)
    send = jnp.zeros((n,), jnp.int32).at[dest].add(1, mode="drop")
    payload = {
        "x": jax.tree_util.tree_map(lambda a: a[order], x),
        "e": (expert % experts_per_rank)[order].astype(jnp.int32),
    }
    got, recv, plan = ragged_exchange(payload, axis_name, send, out_size=cap, rows=max_per_rank)
    valid = jnp.arange(cap) < jnp.sum(recv)
    return got["x"], got["e"], valid, Routing(order, send, recv, plan, max_per_rank)


def combine(y: PyTree, routing: Routing, axis_name: AxisName) -> PyTree:
    """Return the experts' outputs ``y`` (rows as :func:`dispatch` delivered them) to the
    tokens' ranks, in the original token order; dropped tokens get zeros.

    Equivalent to the inverse of :func:`dispatch`: ``out[i] = y_on_expert_rank[row of token
    i]``. Lowering: one ragged all-to-all by the dispatch's own plan, reversed (each expert
    rank returns exactly what it kept, to the rows of its sender's sorted buffer it came
    from: no new exchange of sizes), then one scatter that undoes the sort. Differentiable
    in ``y``.

    Args:
        y: the outputs, leaves ``(capacity, ...)``.
        routing: from :func:`dispatch`.
        axis_name: the expert-parallel mesh axis.

    Returns:
        Leaves ``(T, ...)`` in this rank's token order.
    """
    t = routing.order.shape[0]
    rows = routing.rows
    back = ragged_return(y, axis_name, routing.plan, out_size=t, rows=rows)  # sorted order
    return jax.tree_util.tree_map(lambda a: jnp.zeros_like(a).at[routing.order].set(a), back)
