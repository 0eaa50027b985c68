"""GPipe pipeline parallelism on send/recv: micro-batches flow forward through the stages of a
``stage`` mesh axis, cotangents flow back, gradients accumulate over micro-batches.

Seed 003 names pipelines as what send/recv are for; here every transfer is one
:func:`jaxcoll.primitives.sendrecv` (one ``lax.ppermute``) between neighbouring stages.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import primitives
from .._core.typing import PyTree
from .._core.vma import cast_varying, varying_axes


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle share of a GPipe schedule: ``(S - 1) / (M + S - 1)`` for S stages and M
    micro-batches (forward and backward each take M + S - 1 steps, of which every stage is
    busy for M).

    Example::

        >>> bubble_fraction(4, 8)
        0.2727272727272727
    """
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def _names(*trees: Any) -> tuple:
    """Every mesh axis any leaf of ``trees`` varies over (shard_map's types), sorted."""
    out: set = set()
    for leaf in jax.tree_util.tree_leaves(trees):
        out |= set(varying_axes(leaf) or ())
    return tuple(sorted(out, key=str))


def _microbatches(api: str, x: jax.Array, m: int) -> jax.Array:
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"{api}: num_microbatches={m!r} must be a positive int.")
    if x.ndim == 0 or x.shape[0] % m:
        raise ValueError(
            f"{api}: the batch has {x.shape[0] if x.ndim else 0} examples, which "
            f"do not split into num_microbatches={m} equal micro-batches. Pick a "
            f"divisor of the per-replica batch size."
        )
    return x.reshape((m, x.shape[0] // m) + x.shape[1:])


def _check_targets(api: str, examples: int, y: PyTree) -> None:
    """Every leaf of ``y`` has one row per example of ``x``: micro-batch i of ``x`` is scored
    against rows of ``y`` cut the same way, so other counts would pair the wrong rows."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(y)[0]:
        shape = jnp.shape(leaf)
        if not shape or shape[0] != examples:
            got = f"{shape[0]} examples" if shape else "no leading axis (a scalar)"
            raise ValueError(
                f"{api}: y{jax.tree_util.keystr(path)} has {got} but x has "
                f"{examples}; the last stage scores micro-batch i of x against "
                f"the same rows of y, so y needs one target per example of x. "
                f"Pass the targets of exactly this replica's rows of x (a leading "
                f"axis of {examples})."
            )


def _forward(
    api: str, stage_fn: Callable, params: PyTree, xs: jax.Array, stage_axis: Hashable
) -> tuple[jax.Array, jax.Array]:
    """The forward schedule: at step t stage s runs micro-batch t - s. Returns each stage's
    saved inputs ``(M, mb, ...)`` and, on the last stage, the outputs."""
    n_stages = primitives.world_size(stage_axis)
    m = xs.shape[0]
    s = primitives.rank(stage_axis)
    probe = jax.eval_shape(stage_fn, params, xs[0])
    if (probe.shape, probe.dtype) != (xs.shape[1:], xs.dtype):
        raise ValueError(
            f"{api}: stage_fn maps a micro-batch of shape {xs.shape[1:]} "
            f"{xs.dtype} to {probe.shape} {probe.dtype}; every stage must keep the "
            f"activation's shape and dtype (one SPMD program runs every stage). "
            f"Pad or project the activations to one width."
        )
    names = _names(params, xs, s)
    zero = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), names)
    buffers = cast_varying(jnp.zeros(xs.shape, xs.dtype), names)
    forward = [(i, i + 1) for i in range(n_stages - 1)]

    def step(carry, t):
        received, saved, outs = carry
        mb = t - s
        active = (mb >= 0) & (mb < m)
        k = jnp.clip(mb, 0, m - 1)
        inp = jnp.where(s == 0, xs[jnp.clip(t, 0, m - 1)], received)
        out = stage_fn(params, inp)
        saved = saved.at[k].set(jnp.where(active, inp, saved[k]))
        outs = outs.at[k].set(jnp.where(active & (s == n_stages - 1), out, outs[k]))
        # -> the activation crosses to the next stage (send/recv: one ppermute)
        return (primitives.sendrecv(out, stage_axis, forward), saved, outs), None

    (_, saved, outs), _ = lax.scan(step, (zero, buffers, buffers), jnp.arange(m + n_stages - 1))
    return saved, outs


def pipeline_apply(
    stage_fn: Callable[[PyTree, jax.Array], jax.Array],
    params: PyTree,
    x: jax.Array,
    *,
    stage_axis: Hashable,
    num_microbatches: int,
) -> jax.Array:
    """Run ``x`` through every stage of the pipeline; every stage gets the last one's output.

    Call inside ``jax.shard_map`` with this stage's ``params`` (stage s holds stage s's).
    Equivalent to::

        def pipeline_apply(stage_fn, params, x):
            for s in range(world_size(stage_axis)):
                x = stage_fn(params_of_stage(s), x)
            return x

    Lowering: the GPipe forward schedule of :func:`pipeline_value_and_grad` (a ``lax.scan``
    of M + S - 1 steps, one ``sendrecv`` each), then a broadcast from the last stage.

    Example (4 devices as 4 stages)::

        >>> f = jax.shard_map(lambda w, x: pipeline_apply(lambda w, h: h * w[0], w, x,
        ...                   stage_axis="stage", num_microbatches=2), mesh=mesh,
        ...                   in_specs=(P("stage"), P()), out_specs=P())
        >>> f(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.ones(4))
        Array([24., 24., 24., 24.], dtype=float32)
    """
    api = "pipeline_apply"
    xs = _microbatches(api, x, num_microbatches)
    _, outs = _forward(api, stage_fn, params, xs, stage_axis)
    last = primitives.world_size(stage_axis) - 1
    return primitives.broadcast(outs.reshape(x.shape), stage_axis, last)


def pipeline_value_and_grad(
    stage_fn: Callable[[PyTree, jax.Array], jax.Array],
    loss_fn: Callable[[jax.Array, PyTree], jax.Array],
    params: PyTree,
    x: jax.Array,
    y: PyTree,
    *,
    stage_axis: Hashable,
    num_microbatches: int,
    data_axis: Hashable | None = None,
) -> tuple[jax.Array, PyTree]:
    """The loss of a staged model and this stage's gradient, by a GPipe schedule.

    Call inside ``jax.shard_map`` over a mesh with a ``stage_axis`` (stage s holds the params
    of stage s, e.g. ``in_specs=P("stage")`` on params stacked by stage) and optionally a
    ``data_axis`` (each replica gets its part of the batch). Equivalent to (one device)::

        def model_loss(all_params, x, y):
            for s in range(S):
                x = stage_fn(all_params[s], x)
            return loss_fn(x, y)         # a MEAN over the examples
        loss, grads = jax.value_and_grad(model_loss)(all_params, x_global, y_global)
        return loss, grads[stage]

    The schedule: the replica's batch splits into M micro-batches. Forward, at step t stage s
    runs micro-batch t - s and sends its activation to stage s + 1 (``sendrecv``: one
    ``lax.ppermute``). The last stage takes ``loss_fn`` of each micro-batch. Backward, in
    reverse, stage s takes the cotangent from stage s + 1, recomputes its forward for that
    micro-batch (re-materialisation, as GPipe does: only the stage inputs are kept), and sends
    the input cotangent to stage s - 1; each stage accumulates its parameter gradient over the
    M micro-batches. 2(M + S - 1) steps, of which each stage is idle for 2(S - 1): the bubble
    (:func:`bubble_fraction`). With ``data_axis`` the gradient is then averaged over the
    replicas by one all-reduce (exactly once: params are made varying over the axes first, so
    ``jax.vjp`` adds no hidden reduction; see the gradient trap in docs/dp.md).

    Args:
        stage_fn: ``(stage_params, h) -> h``; every stage keeps the activation's shape and
            dtype (one program runs every stage: pad to one width if stages differ).
        loss_fn: ``(h_last, y_microbatch) -> scalar``, the MEAN loss over the micro-batch.
        params: this stage's parameters (a pytree).
        x: this replica's input batch ``(B, ...)``, read by stage 0 (the others may pass the
            same array; only its shape is used there).
        y: this replica's targets, leading axis B (a pytree, every leaf one row per example
            of ``x``), read by the last stage.
        stage_axis: the mesh axis of the stages.
        num_microbatches: M; must divide B.
        data_axis: the mesh axis of data-parallel replicas, or None.

    Returns:
        ``(loss, grads)``: the global mean loss (the same on every device) and this stage's
        gradient averaged over the replicas.

    Example (2 data x 4 stages): see ``examples/06_pipeline.py``.
    """
    api = "pipeline_value_and_grad"
    xs = _microbatches(api, x, num_microbatches)
    _check_targets(api, x.shape[0], y)
    ys = jax.tree_util.tree_map(lambda v: _microbatches(api, v, num_microbatches), y)
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    m = num_microbatches
    # Varying over every axis first: jax.vjp then gives this device's own contribution, and
    # the one reduction over data below is the only one.
    axes = (stage_axis,) + ((data_axis,) if data_axis is not None else ())
    own = jax.tree_util.tree_map(lambda p: cast_varying(p, axes), params)
    saved, outs = _forward(api, stage_fn, own, xs, stage_axis)

    losses, grads_out = jax.vmap(jax.value_and_grad(loss_fn))(outs, ys)  # last stage's are real
    grads_out = grads_out / m  # d(mean over micro-batches)/d(out)
    backward = [(i + 1, i) for i in range(n_stages - 1)]
    names = _names(own, saved)

    def step(carry, t):
        received, acc = carry
        u = t - (n_stages - 1 - s)
        active = (u >= 0) & (u < m)
        k = jnp.clip(m - 1 - u, 0, m - 1)
        ct = jnp.where(s == n_stages - 1, grads_out[k], received)
        _, vjp = jax.vjp(stage_fn, own, saved[k])
        d_params, d_input = vjp(ct)
        acc = jax.tree_util.tree_map(
            lambda a, d: a + jnp.where(active, d, jnp.zeros_like(d)), acc, d_params
        )
        # <- the cotangent crosses back to the previous stage (send/recv: one ppermute)
        return (primitives.sendrecv(d_input, stage_axis, backward), acc), None

    zero_ct = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), names)
    zeros = jax.tree_util.tree_map(
        lambda p: cast_varying(jnp.zeros(p.shape, p.dtype), _names(p)), own
    )
    (_, grads), _ = lax.scan(step, (zero_ct, zeros), jnp.arange(m + n_stages - 1))

    loss = primitives.all_reduce(jnp.where(s == n_stages - 1, jnp.mean(losses), 0.0), stage_axis)
    if data_axis is not None:
        # Gradients cross the data replicas here, once: the mean of the replicas' means.
        grads = primitives.all_reduce(grads, data_axis, "avg")
        loss = primitives.all_reduce(loss, data_axis, "avg")
    return loss, grads
