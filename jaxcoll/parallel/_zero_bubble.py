"""The lowering of :class:`~jaxcoll.parallel.ZeroBubble` (ZB-H1): a table of F, B and W slots.

The schedule's :meth:`~jaxcoll.parallel.ZeroBubble.table` is computed on the host and baked
into the program as two small int arrays (operation and micro-batch, stage x slot). One
``lax.scan`` runs its slots; in each, every stage runs its own entry (a ``lax.switch``:
nothing, a forward, B or W), then one ``sendrecv`` moves every forward's output one stage up
and one moves every B's input gradient one stage down. What arrives is kept, by micro-batch,
until the stage's W of it: stage inputs (the forward's, B's and W's recomputation start from
them) and output cotangents. B differentiates the stage with respect to its input only, W
with respect to its params only, each recomputing the forward from the kept input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import primitives
from .._core.typing import PyTree
from .._core.vma import cast_varying
from ._lowering import Staged, axes_of

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
_KINDS = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}


def tables(rows: list) -> tuple[np.ndarray, np.ndarray]:
    """``(kind, micro-batch)``: the table as arrays (stage x slot)."""
    stages, slots = len(rows), len(rows[0])
    kind = np.zeros((stages, slots), np.int32)
    mb = np.zeros((stages, slots), np.int32)
    for s, row in enumerate(rows):
        for t, op in enumerate(row):
            if op is not None:
                kind[s, t], mb[s, t] = _KINDS[op[0]], op[1]
    return kind, mb


def zero_bubble(
    p: Staged, rows: list, keep: int, act: tuple
) -> tuple[jax.Array, PyTree, PyTree, jax.Array]:
    """Run the table ``rows`` (:meth:`ZeroBubble.table`), keeping stage inputs and output
    cotangents in ``keep`` buffers (:meth:`ZeroBubble.kept_inputs`: micro-batch i in buffer
    i mod ``keep``). ``loss_fn`` is ``(head, out, y) ->
    mean loss``; ``act``: the axes the activations vary over. Returns what the other
    lowerings return: the last stage's mean loss (0 elsewhere), this stage's gradient summed
    over micro-batches of the mean loss, the head's gradient (the last stage's) and the
    inputs' (stage 0's)."""
    stage_fn, loss_fn, own, xs, ys, stage_axis, head = p.parts()
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    last = n_stages - 1
    m = xs.shape[0]
    kind_np, mb_np = tables(rows)
    kinds, mbs = jnp.asarray(kind_np), jnp.asarray(mb_np)
    zero = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), act)
    inputs0 = cast_varying(jnp.zeros((keep,) + xs.shape[1:], xs.dtype), act)
    zeros = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), axes_of(p)), own)
    head0 = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), axes_of(p)), head)
    leaves = jax.tree_util.tree_leaves((ys, head))
    loss0 = cast_varying(
        jnp.zeros((), jnp.float32), tuple(sorted(set(act).union(*map(axes_of, leaves)), key=str))
    )
    d_xs0 = cast_varying(jnp.zeros(xs.shape, xs.dtype), act)
    template = (zero, zero, inputs0, inputs0, zeros, head0, loss0, d_xs0)
    up = [(i, i + 1) for i in range(last)]
    down = [(i + 1, i) for i in range(last)]

    def typed(tree: PyTree) -> PyTree:
        return jax.tree_util.tree_map(lambda v, r: cast_varying(v, axes_of(r)), tree, template)

    def one_slot(carry, t):
        inputs, cts, acc, acc_head, loss, d_xs = carry
        k = mbs[s, t]
        inp = jnp.where(s == 0, xs[k], inputs[k % keep])
        state = (zero, zero, inputs, cts, acc, acc_head, loss, d_xs)

        def idle():
            return typed(state)

        def forward():
            out = stage_fn(own, inp)
            y = jax.tree_util.tree_map(lambda v: v[k], ys)
            # Used on the last stage only: its output's cotangent is kept for B and W.
            value, (d_head, d_out) = jax.value_and_grad(loss_fn, argnums=(0, 1))(head, out, y)
            at_last = s == last
            return typed(
                (
                    out,
                    zero,
                    inputs.at[k % keep].set(inp),
                    cts.at[k % keep].set(jnp.where(at_last, d_out / m, cts[k % keep])),
                    acc,
                    jax.tree_util.tree_map(
                        lambda a, d: a + jnp.where(at_last, d / m, jnp.zeros_like(d)),
                        acc_head,
                        d_head,
                    ),
                    loss + jnp.where(at_last, value.astype(jnp.float32), 0.0),
                    d_xs,
                )
            )

        def backward():  # B: the input's gradient, which the stage below waits for
            _, vjp = jax.vjp(lambda h: stage_fn(own, h), inp)
            (d_input,) = vjp(cts[k % keep])
            d_xs_new = d_xs.at[k].set(jnp.where(s == 0, d_input, d_xs[k]))
            return typed((zero, d_input, inputs, cts, acc, acc_head, loss, d_xs_new))

        def weight():  # W: the params' gradient, which nobody waits for
            _, vjp = jax.vjp(lambda p: stage_fn(p, inp), own)
            (d_params,) = vjp(cts[k % keep])
            acc_new = jax.tree_util.tree_map(jnp.add, acc, d_params)
            return typed((zero, zero, inputs, cts, acc_new, acc_head, loss, d_xs))

        branch = kinds[s, t]
        out, d_input, inputs, cts, acc, acc_head, loss, d_xs = lax.switch(
            branch, (idle, forward, backward, weight)
        )
        # -> every forward's output one stage up, <- every B's input gradient one stage down
        got_up = primitives.sendrecv(out, stage_axis, up)
        got_down = primitives.sendrecv(d_input, stage_axis, down)
        below, above = jnp.maximum(s - 1, 0), jnp.minimum(s + 1, last)
        from_below = (s > 0) & (kinds[below, t] == FORWARD)
        from_above = (s < last) & (kinds[above, t] == BACKWARD)
        i, j = mbs[below, t] % keep, mbs[above, t] % keep
        inputs = inputs.at[i].set(jnp.where(from_below, got_up, inputs[i]))
        cts = cts.at[j].set(jnp.where(from_above, got_down, cts[j]))
        return (inputs, cts, acc, acc_head, loss, d_xs), None

    carry = (inputs0, inputs0, zeros, head0, loss0, d_xs0)
    (_, _, grads, d_head, loss, d_xs), _ = lax.scan(one_slot, carry, jnp.arange(kind_np.shape[1]))
    return loss / m, grads, d_head, d_xs
