"""GPipe's and 1F1B's lowerings: every stage in lock-step, one ``sendrecv`` between steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import primitives
from .._core.typing import PyTree
from .._core.vma import cast_varying
from ._lowering import Staged, add_aux, aux_zeros
from ._stages import _at, _carried, _check_stage, _forward_aux, _names, _put, _targets_at


def _gpipe(api: str, p: Staged) -> tuple[jax.Array, PyTree, PyTree, jax.Array, tuple]:
    """GPipe: all forwards (saving M stage inputs), then all backwards. ``loss_fn`` is
    ``(head, out, y) -> mean loss``. Returns the last stage's mean loss (garbage elsewhere),
    this stage's gradient summed over micro-batches of the mean loss, the gradient of
    ``head`` (the last stage's; zero elsewhere) and that of the inputs ``xs`` (stage 0's;
    zero elsewhere) and ``(terms, auxs)`` (:func:`aux_zeros`: this stage's loss terms summed
    over micro-batches, its aux per micro-batch)."""
    stage_fn, loss_fn, own, xs, ys, stage_axis, head = p.parts()
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    m = xs.shape[0]
    saved, outs, extra = _forward_aux(
        api, stage_fn, own, xs, stage_axis, sides=p.sides, has_aux=p.has_aux
    )
    term_axes = _names(extra[0])

    # The head runs on the last stage alone (a cond: the others skip its FLOPs).
    grad = jax.value_and_grad(loss_fn, argnums=(0, 1))
    typed = (*_names(head, outs, ys), stage_axis)

    def head_all():
        # outs (M, mb, ...), the targets (mb, M, ...) read in place
        losses, (d_heads, grads_out) = jax.vmap(grad, in_axes=(None, 0, 1))(head, outs, ys)
        d_head = jax.tree_util.tree_map(lambda d: jnp.sum(d, 0) / m, d_heads)
        out = (jnp.mean(losses).astype(jnp.float32), d_head, grads_out / m)
        return jax.tree_util.tree_map(lambda v: cast_varying(v, typed), out)

    def no_head():
        shapes = jax.eval_shape(head_all)
        return jax.tree_util.tree_map(
            lambda v: cast_varying(jnp.zeros(v.shape, v.dtype), typed), shapes
        )

    # d(mean over micro-batches)/d(out), the head's gradient: the last stage's; zeros elsewhere
    loss, d_head, grads_out = lax.cond(s == n_stages - 1, head_all, no_head)
    backward = [(i + 1, i) for i in range(n_stages - 1)]
    names = _names(saved)  # the activations' axes, so their cotangents' too

    def step(carry, t):
        received, acc, d_xs = carry
        u = t - (n_stages - 1 - s)
        active = (u >= 0) & (u < m)
        k = jnp.clip(m - 1 - u, 0, m - 1)
        ct = jnp.where(s == n_stages - 1, grads_out[k], received)
        d_params, d_input = p.pullback(own, saved[k], k, term_axes)(ct)
        acc = jax.tree_util.tree_map(
            lambda a, d: a + jnp.where(active, d, jnp.zeros_like(d)), acc, d_params
        )
        d_xs = _put(d_xs, k, jnp.where(active & (s == 0), d_input, _at(d_xs, k)))
        # <- the cotangent crosses back to the previous stage (send/recv: one ppermute)
        return (primitives.sendrecv(d_input, stage_axis, backward), acc, d_xs), None

    zero_ct = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), names)
    zeros = jax.tree_util.tree_map(
        lambda p: cast_varying(jnp.zeros(p.shape, p.dtype), _names(p)), own
    )
    d_xs0 = cast_varying(jnp.zeros(xs.stack.shape, xs.dtype), names)  # laid out as xs
    (_, grads, d_xs), _ = lax.scan(step, (zero_ct, zeros, d_xs0), jnp.arange(m + n_stages - 1))
    return loss, grads, d_head, d_xs, extra


def _typed_as(tree: PyTree, template: PyTree) -> PyTree:
    """A branch's outputs typed as ``template`` (every branch of a switch or cond alike)."""
    return jax.tree_util.tree_map(lambda v, r: cast_varying(v, _names(r)), tree, template)


def _slot_template(p: Staged, act: tuple, keep: int) -> tuple:
    """1F1B's slot state, zero: ``(message, saved inputs, own cotangent, gradient, loss,
    head's gradient, inputs' gradient, (loss terms, aux))``, each typed as what it holds:
    activations (and their cotangents) over ``act``, the axes the forward's do vary over
    (:func:`_carried`), gradients as their params, the loss over those of the activations,
    targets and head, the stage's loss terms and aux as :func:`aux_zeros` types them."""
    _, _, own, xs, ys, _, head = p.parts()
    zero = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), act)
    saved0 = cast_varying(jnp.zeros((keep,) + xs.shape[1:], xs.dtype), act)
    zeros = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), _names(p)), own)
    loss0 = cast_varying(jnp.zeros((), jnp.float32), _names(zero, ys, head))
    head0 = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), _names(p)), head)
    d_xs0 = cast_varying(jnp.zeros(xs.stack.shape, xs.dtype), act)  # laid out as xs
    return (zero, saved0, zero, zeros, loss0, head0, d_xs0, aux_zeros(p, act))


def _slot_pairs(n_stages: int) -> tuple[list, list]:
    """The ``sendrecv`` pairs of an even and of an odd slot. Slot t: stage s works forward iff
    t - s is even, so in an even slot the even stages send forward and the odd ones back
    (pairs 0-1, 2-3, ...), in an odd slot the pairs 1-2, 3-4, ..."""
    last = n_stages - 1
    even = [(i, i + 1) for i in range(0, last, 2)] + [(i, i - 1) for i in range(1, n_stages, 2)]
    odd = [(i, i + 1) for i in range(1, last, 2)] + [(i, i - 1) for i in range(2, n_stages, 2)]
    return even, odd


def _forward_branch(
    p: Staged, template: tuple, s: jax.Array, fi: jax.Array, keep: int, received: Any, state: tuple
) -> Callable[[], tuple]:
    """Stage ``s``'s forward of micro-batch ``fi``, as a branch of the slot's switch; on the
    last stage the head's too (a cond of its own: the other stages skip it), its loss and the
    cotangent the backward starts from. ``state``: the slot's carry but the message."""
    stage_fn, loss_fn, own, xs, ys, _, head = p.parts()
    m = xs.shape[0]
    zero, _, _, _, loss0, head0, _, _ = template
    at_last, own_ct, saved, acc, loss, acc_head, d_xs, extra = state

    def typed_head(tree: PyTree) -> PyTree:
        """The head's cond's outputs typed as theirs in ``template``."""
        return _typed_as(tree, (zero, loss0, head0))

    def run_forward():
        inp = jnp.where(s == 0, xs[fi], received)
        out, term, aux = p.forward(own, inp, fi)
        extra_new = add_aux(extra, term, aux, fi)
        saved_new = saved.at[fi % keep].set(inp)

        def head_part():
            y = _targets_at(ys, fi)
            value, (d_head, d_out) = jax.value_and_grad(loss_fn, argnums=(0, 1))(head, out, y)
            acc_head_new = jax.tree_util.tree_map(lambda a, d: a + d / m, acc_head, d_head)
            return typed_head((d_out / m, loss + value.astype(jnp.float32), acc_head_new))

        def no_head():
            return typed_head((own_ct, loss, acc_head))

        own_ct_new, loss_new, acc_head_new = lax.cond(at_last, head_part, no_head)
        new = (out, saved_new, own_ct_new, acc, loss_new, acc_head_new, d_xs, extra_new)
        return _typed_as(new, template)

    return run_forward


def _one_f_one_b(api: str, p: Staged) -> tuple[jax.Array, PyTree, PyTree, jax.Array, tuple]:
    """1F1B in lock-step slots: in slot t stage s runs the forward of micro-batch (t - s) / 2
    when t - s is even, the backward of micro-batch (t - 2S + 1 + s) / 2 when it is odd; after
    each slot one ``sendrecv`` moves every forward's activation to s + 1 and every backward's
    cotangent to s - 1. Stage inputs are kept in ``min(S, M)`` slots, micro-batch i in slot
    i mod min(S, M). Each slot a stage runs one branch of a ``lax.switch`` on its own
    predicate: a forward, or a recomputed forward and a backward, GPipe's work in another
    order; the last stage's forwards run the head too (a branch of their own, so the other
    stages skip its FLOPs). Returns what :func:`_gpipe` returns (``loss_fn`` as there)."""
    stage_fn, _, own, xs, _, stage_axis, _ = p.parts()
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    last = n_stages - 1
    m = xs.shape[0]
    _check_stage(api, stage_fn, own, xs, p.sides, p.has_aux)
    keep = min(n_stages, m)
    template = _slot_template(p, _carried(stage_fn, own, xs, s, p.sides, p.has_aux), keep)
    zero, saved0, _, zeros, loss0, head0, d_xs0, extra0 = template
    term_axes = _names(extra0[0])
    even, odd = _slot_pairs(n_stages)

    def slot(carry, t, pairs):
        received, own_ct, saved, acc, loss, acc_head, d_xs, extra = carry
        forward = (t - s) % 2 == 0
        i = (t - s) // 2  # the forward's micro-batch
        j = (t - 2 * last - 1 + s) // 2  # the backward's micro-batch
        fi, bj = jnp.clip(i, 0, m - 1), jnp.clip(j, 0, m - 1)
        at_last = s == last

        # Each branch updates the state itself (no zero trees, no masked sums; measured in a
        # Trainer step, less memory than updating it after the switch): the idle slots of the
        # warm-up and drain compute nothing.
        def idle():
            return _typed_as((zero, saved, own_ct, acc, loss, acc_head, d_xs, extra), template)

        state = (at_last, own_ct, saved, acc, loss, acc_head, d_xs, extra)
        run_forward = _forward_branch(p, template, s, fi, keep, received, state)

        def run_backward():
            ct = jnp.where(at_last, own_ct, received)
            vjp = p.pullback(own, saved[bj % keep], bj, term_axes)
            d_params, d_input = vjp(ct)
            acc_new = jax.tree_util.tree_map(jnp.add, acc, d_params)
            d_xs_new = _put(d_xs, bj, jnp.where(s == 0, d_input, _at(d_xs, bj)))
            new = (d_input, saved, own_ct, acc_new, loss, acc_head, d_xs_new, extra)
            return _typed_as(new, template)

        fwd = forward & (i >= 0) & (i < m)
        bwd = ~forward & (j >= 0) & (j < m)
        branch = jnp.where(fwd, 1, jnp.where(bwd, 2, 0))
        message, saved, own_ct, acc, loss, acc_head, d_xs, extra = lax.switch(
            branch, (idle, run_forward, run_backward)
        )
        # -> activations to s + 1, <- cotangents to s - 1: one sendrecv (one ppermute)
        sent = primitives.sendrecv(message, stage_axis, pairs)
        return sent, own_ct, saved, acc, loss, acc_head, d_xs, extra

    def step(carry, k):
        carry = slot(carry, 2 * k, even)
        return slot(carry, 2 * k + 1, odd), None

    carry = (zero, zero, saved0, zeros, loss0, head0, d_xs0, extra0)
    (_, _, _, grads, loss, d_head, d_xs, extra), _ = lax.scan(
        step, carry, jnp.arange(m + n_stages - 1)
    )
    return loss / m, grads, d_head, d_xs, extra
