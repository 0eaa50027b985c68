"""A pipelined model's loss that ``jax.grad`` differentiates by the schedule's own backward.

:func:`pipeline_value_and_grad` owns the step: it returns the loss and the stages' gradient,
so a trainer built on ``jax.value_and_grad`` cannot call it. :func:`pipeline_loss` is the same
schedule behind a ``jax.custom_vjp``: its forward runs the whole schedule (every forward and
every backward, in the schedule's order, with its bounded activation memory) and keeps the
gradients as residuals; its backward scales them by the incoming cotangent. So it goes inside
any loss: the embedding before it and the Trainer's ``jax.value_and_grad`` around it get
their gradients as usual, and 1F1B, interleaved 1F1B or ZB-H1 runs inside ``dp.Trainer``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import primitives
from .._core.axis import bound
from .._core.roles import Role
from .._core.typing import PyTree
from .._core.vma import cast_varying
from . import _interleaved
from ._lowering import axes_of, call_stage
from ._stages import MicroBatches, _at, _forward_aux, _microbatches, _names, in_place
from .pipeline import lower, resolve_axis, resolve_schedule, split_batch, split_side
from .schedules import Interleaved, Schedule


def pipeline_loss(
    stage_fn: Callable[..., jax.Array],
    head_fn: Callable[[PyTree, jax.Array, PyTree], jax.Array],
    stage_params: PyTree,
    head_params: PyTree,
    x: jax.Array,
    y: PyTree,
    *,
    axis_name: Hashable | None = Role.PIPELINE,
    schedule: Schedule | None = None,
    side: PyTree = None,
    has_aux: bool = False,
) -> Any:
    """The mean loss of a staged model over this replica's batch, differentiable (``jax.grad``)
    with respect to ``stage_params``, ``head_params`` and ``x`` through ``schedule``'s own
    backward: the pipeline's loss for a ``dp.Trainer``.

    Call inside ``jax.shard_map`` (e.g. inside a ``dp.Trainer`` loss) over a mesh with a stage
    axis ``axis_name``. Equivalent to (one device, stage s holding ``stage_params`` of stage
    s)::

        def loss(all_stage_params, head_params, x, y):
            for s in range(S):
                x = stage_fn(all_stage_params[s], x)    # (..., x, side_mb) with side=
            return mean over micro-batches of head_fn(head_params, x_mb, y_mb)

    with, for ``Interleaved(M, virtual=v)``, this stage's v chunks stacked on a leading axis
    of ``stage_params`` (chunk c is model chunk ``c*S + s``). Layers stacked ``(L, ...)`` in
    the model's order and reshaped to ``(v, L // v, ...)`` with the spec
    ``P(None, axis_name, ...)`` are placed so (stage s gets the s-th slice of each of the v
    parts), and in dense mode the two leading axes are read back in order. Layers passed
    ``(L, ...)`` without that reshape are refused at trace time (every leaf must be
    ``(v, n, ...)`` with one n, and ``stage_fn`` must take one chunk): the message names the
    reshape, ``jax.tree.map(lambda t: t.reshape((v, t.shape[0] // v) + t.shape[1:]),
    blocks)`` with ``P(None, "layers", ...)``. The value is the
    same on every stage; the gradient of ``stage_params`` is this stage's, that of
    ``head_params`` the last stage's and that of ``x`` stage 0's, each reaching the others
    through the reductions ``jax.grad`` makes for values shared over the stage axis (an
    embedding before the pipeline, a head tied to it). Nothing is reduced over other axes
    here: a data axis is the caller's (the Trainer's) to average over, as for any loss.

    **Side inputs.** ``side`` (a pytree of per-example arrays: positions, segment ids,
    attention masks of packed or padded sequences) is cut into the same micro-batches as
    ``x``, and every stage calls ``stage_fn(stage_params, h, side_microbatch)`` with the
    micro-batch it runs; each stage reads its own copy (the replica's whole batch is on every
    stage), so nothing crosses between stages for it. Side inputs are not differentiated:
    integer ones work, and a float one gets no gradient (it is a constant to the loss, as if
    wrapped in ``jax.lax.stop_gradient``, in dense mode too).

    **Dense mode.** Where the stage axis is not bound (no enclosing ``jax.shard_map`` names it,
    or the Trainer's layout has no pipeline axis: a single-device run of the same model code),
    it returns ``stage_fn(stage_params, x)`` with ALL stages' params (e.g. layers stacked on
    a leading axis that ``stage_fn`` scans over, which the pipelined run splits over the
    stages), then the head on each micro-batch, differentiated by ``jax.grad`` as usual. One
    model definition then serves both runs.

    Differentiated, the forward runs every micro-batch's forward and backward, so the backward
    costs nothing more; the residuals are the gradients (the params' size), not activations.
    Activation memory is the schedule's: :meth:`Schedule.kept_inputs` stage inputs. Not
    differentiated (an evaluation), only the forwards run. Where the step is your own (the
    loss and this stage's gradient at once, a data axis averaged once), the same schedules run
    by :func:`~jaxcoll.parallel.pipeline_value_and_grad`.

    **Stage losses and aux** (``has_aux=True``). Each stage's call on micro-batch i returns
    its loss term ``t[s, i]`` and aux ``a[s, i]``; the loss is then::

        mean over i of (head_fn(head_params, h_last_i, y_i) + sum over s of t[s, i])

    (each term belongs to its micro-batch, as a Trainer's ``accum_steps`` makes a mixture of
    experts' load-balancing loss that of each micro-batch; micro-batch i is the replica's
    rows i::M, its share of the global rows i::M, as ``accum_steps`` cuts them, so which
    examples share a micro-batch is the same on every layout and in dense mode), and
    ``aux`` holds every ``a[s,
    i]``: each leaf ``(S, M, ...)``, the same on every stage (in dense mode ``(1, M, ...)``:
    one call over all the stages' params on each micro-batch). A term computed from values
    reduced over a data axis (a load summed over the replicas) is each replica's, so the
    caller's average over the replicas keeps it once, as for a dense model. GPipe, 1F1B and
    ZB-H1 run it (ZB-H1's B and W each take the term's share); :class:`Interleaved` refuses it.

    Args:
        stage_fn: ``(stage_params, h) -> h``, or ``(stage_params, h, side) -> h`` when
            ``side`` is given, keeping the activation's shape and dtype; with ``has_aux``,
            ``-> (h, (loss_term, aux))``.
        head_fn: ``(head_params, h_last, y_microbatch) -> scalar``, the MEAN loss over the
            micro-batch (the output head and the loss: run on the last stage only).
        stage_params: this stage's params (leading axis v with :class:`Interleaved`).
        head_params: the head's params (a pytree; ``()`` for none).
        x: this replica's stage-0 input ``(B, ...)`` (the embedding's output).
        y: this replica's targets, leading axis B (a pytree).
        axis_name: the mesh axis of the stages, or the role ``Role.PIPELINE`` (the
            default): inside a ``dp.Trainer`` the layout's pipeline axis (dense where it has
            none), elsewhere the mesh axis named ``"pipeline"``.
        schedule: :class:`GPipe`, :class:`OneFOneB`, :class:`Interleaved` or
            :class:`ZeroBubble` with its M micro-batches (M divides B); default: the
            Trainer's layout's ``schedule`` (dense mode without one: the batch whole).
        side: this replica's per-example side inputs (a pytree, every leaf one row per
            example of ``x``), handed to every stage micro-batch by micro-batch; None (the
            default): none, and ``stage_fn`` takes two arguments.

        has_aux: ``stage_fn`` returns ``(h, (loss_term, aux))``: ``loss_term`` a float scalar
            added to the loss of the micro-batch (a weighted load-balancing loss: its gradient
            flows back through the stage, its router included), ``aux`` a pytree of arrays
            kept per micro-batch, not differentiated (a mixture of experts' loads). See
            **Stage losses and aux** above.

    Returns:
        The loss; with ``has_aux``, ``(loss, aux)``.

    Raises:
        TypeError: ``schedule`` not a schedule value (a schedule's name, ``"1f1b"``: the
            message names the value to pass, ``parallel.OneFOneB(M)``), or none given or in
            the layout where the stage axis is bound.
        ValueError: M not dividing B, (interleaved, v > 1) M not a multiple of S, params
            not stacked ``(v, n, ...)`` with :class:`Interleaved` (the message names the
            reshape), a stage that changes the activation's shape, a leaf of ``side``
            without one row per example, a stage not returning ``(h, (loss_term, aux))``
            with ``has_aux``, ``has_aux`` under :class:`Interleaved`.
    """
    api = "pipeline_loss"
    stage_axis = resolve_axis(axis_name)
    dense = stage_axis is None or not bound(api, stage_axis, "axis_name")
    schedule = resolve_schedule(api, schedule, dense)
    xs, ys = split_batch(api, x, y, schedule)
    sides = split_side(api, x, side, schedule)
    if isinstance(schedule, Interleaved):
        stages = None if dense else primitives.world_size(stage_axis)
        if stages is not None:
            schedule.check(api, stages)
        _interleaved.check_layers(api, stage_params, schedule.virtual, stages)
    if not isinstance(has_aux, bool):
        raise TypeError(f"{api}: has_aux must be a bool, got {has_aux!r} instead.")
    if has_aux and isinstance(schedule, Interleaved):
        raise ValueError(
            f"{api}: has_aux=True runs under GPipe, OneFOneB and ZeroBubble, not yet "
            f"{schedule!r}; pass schedule=parallel.OneFOneB({schedule.microbatches}) or "
            f"parallel.ZeroBubble({schedule.microbatches}) (the layers then unreshaped, one "
            f"chunk per stage)."
        )
    pipe = _Pipe(api, schedule, stage_fn, head_fn, None if dense else stage_axis, has_aux)
    if dense and has_aux:
        return _dense_aux(pipe, stage_params, head_params, xs, ys, _constant(sides))
    if dense:
        return _dense(pipe, stage_params, head_params, x, ys, _constant(side))
    out = _scheduled(pipe, stage_params, head_params, xs, ys, sides)
    return out if has_aux else out[0]


@dataclass(frozen=True)
class _Pipe:
    """What a pipelined loss runs: its schedule, stage and head over a bound stage axis
    (None: dense mode)."""

    api: str
    schedule: Schedule
    stage_fn: Callable
    head_fn: Callable
    stage_axis: Hashable | None
    has_aux: bool = False


def _constant(side: PyTree) -> PyTree:
    """The side inputs as constants to the loss: float leaves behind ``stop_gradient`` (dense
    mode gives them no gradient either), the others as they are."""
    return jax.tree_util.tree_map(
        lambda v: lax.stop_gradient(v) if jnp.issubdtype(jnp.result_type(v), jnp.inexact) else v,
        side,
    )


def _dense(
    pipe: _Pipe, stage_params: PyTree, head_params: PyTree, x: jax.Array, ys: PyTree, side: PyTree
) -> jax.Array:
    """Every stage (``stage_params``: all of them) on the whole batch, with its whole side
    inputs, then the head on each micro-batch."""
    if isinstance(pipe.schedule, Interleaved):  # (v, n, ...): the model's layers in order
        chunks = stage_params
        stage_params = jax.tree_util.tree_map(lambda p: p.reshape((-1,) + p.shape[2:]), chunks)

        def probe() -> None:
            run = lambda p, h, sd: call_stage(pipe.stage_fn, p, h, sd)  # noqa: E731
            out = jax.eval_shape(run, stage_params, x, side)
            if (out.shape, out.dtype) != (x.shape, x.dtype):
                raise ValueError(f"it maps {x.shape} {x.dtype} to {out.shape} {out.dtype}")

        _interleaved.check_runs(pipe.api, probe, chunks, pipe.schedule.virtual, None)
    h = call_stage(pipe.stage_fn, stage_params, x, side)
    outs = _microbatches(pipe.api, h, pipe.schedule)  # micro-batch m: rows m::M, as ys's
    return jnp.mean(jax.vmap(pipe.head_fn, in_axes=(None, 1, 1))(head_params, outs, ys))


def _dense_aux(
    pipe: _Pipe,
    stage_params: PyTree,
    head_params: PyTree,
    xs: jax.Array,
    ys: PyTree,
    sides: PyTree,
) -> tuple[jax.Array, PyTree]:
    """Dense mode with stage losses: every stage (``stage_params``: all of them) on each
    micro-batch in turn (rows m::M, read in place), its loss term added to the head's loss
    of that micro-batch."""

    def one(k: jax.Array) -> tuple:
        h, y, side = jax.tree_util.tree_map(lambda t: _at(t, k), (xs, ys, sides))
        out, (term, aux) = call_stage(pipe.stage_fn, stage_params, h, side)
        return pipe.head_fn(head_params, out, y) + term, aux

    losses, aux = lax.map(one, jnp.arange(pipe.schedule.microbatches))
    return jnp.mean(losses), jax.tree_util.tree_map(lambda a: a[None], aux)


def _all_stages(auxs: PyTree, stage_axis: Hashable) -> PyTree:
    """Every stage's ``auxs`` (leaves ``(M, ...)``) as leaves ``(S, M, ...)``, the same on
    every stage: each puts its own at its index, one all-reduce over the stage axis."""
    s = primitives.rank(stage_axis)
    n = primitives.world_size(stage_axis)

    def placed(a: jax.Array) -> jax.Array:
        return jnp.where(jnp.arange(n).reshape((n,) + (1,) * a.ndim) == s, a[None], 0)

    return primitives.all_reduce(jax.tree_util.tree_map(placed, auxs), stage_axis)


def _with_grads(
    pipe: _Pipe, stage_params: PyTree, head_params: PyTree, xs: jax.Array, ys: PyTree, sides: PyTree
) -> tuple:
    """The schedule's forwards and backwards: the loss (the same on every stage) and the
    gradients of the stage's params, the head's and the inputs (the custom_vjp's residuals)."""
    stage_axis = pipe.stage_axis
    s = primitives.rank(stage_axis)
    # Varying over the stage axis and the batch's axes first: the schedule's gradients
    # are then this device's own contributions, and the reductions in the backward the
    # only ones. (Not over the params' other axes: a Megatron block whose output is the
    # same across its tensor axis keeps it so.)
    batch_axes = tuple(sorted(set(_names(xs, ys, sides)) | {stage_axis}, key=str))
    own = jax.tree_util.tree_map(lambda p: cast_varying(p, batch_axes), stage_params)
    head = jax.tree_util.tree_map(lambda p: cast_varying(p, batch_axes), head_params)
    out = lower(
        pipe.api,
        pipe.schedule,
        pipe.stage_fn,
        pipe.head_fn,
        own,
        xs,
        ys,
        stage_axis,
        head,
        sides=sides,
        has_aux=pipe.has_aux,
    )
    last_loss, grads, d_head, d_xs, (terms, auxs) = out
    last = primitives.world_size(stage_axis) - 1
    m = pipe.schedule.microbatches
    # The head's mean loss (the last stage's) and every stage's loss terms' mean.
    mine = jnp.where(s == last, last_loss, 0.0) + terms / m
    loss = primitives.all_reduce(mine, stage_axis)
    return (loss, _all_stages(auxs, stage_axis)), (grads, d_head, d_xs)


def _forwards_only(
    pipe: _Pipe, stage_params: PyTree, head_params: PyTree, xs: jax.Array, ys: PyTree, sides: PyTree
) -> Any:
    """Not differentiated (an evaluation): the forwards alone, as GPipe's forward
    schedule, once per chunk (the last stage's outputs feed stage 0's next chunk)."""
    stage_axis, schedule = pipe.stage_axis, pipe.schedule
    s = primitives.rank(stage_axis)
    last = primitives.world_size(stage_axis) - 1
    h, sides = MicroBatches(xs), in_place(sides)  # micro-batch m: rows m::M, in place
    for c in range(schedule.virtual):
        params = stage_params
        if isinstance(schedule, Interleaved):
            params = jax.tree_util.tree_map(lambda p, c=c: p[c], stage_params)
        _, outs, (terms, auxs) = _forward_aux(
            pipe.api, pipe.stage_fn, params, h, stage_axis, sides=sides, has_aux=pipe.has_aux
        )
        if c < schedule.virtual - 1:  # the outputs (M, mb, ...): the next chunk's inputs
            h = MicroBatches(primitives.broadcast(outs, stage_axis, last), axis=0)
    typed = (*_names(head_params, outs, ys), stage_axis)

    def head() -> jax.Array:  # the last stage's alone (a cond: the others skip it)
        losses = jax.vmap(pipe.head_fn, in_axes=(None, 0, 1))(head_params, outs, ys)
        return cast_varying(jnp.mean(losses).astype(jnp.float32), typed)

    value = lax.cond(s == last, head, lambda: cast_varying(jnp.zeros((), jnp.float32), typed))
    value = value + terms / schedule.microbatches
    return primitives.all_reduce(value, stage_axis), _all_stages(auxs, stage_axis)


def _scheduled(
    pipe: _Pipe, stage_params: PyTree, head_params: PyTree, xs: jax.Array, ys: PyTree, sides: PyTree
) -> jax.Array:
    """The schedule behind a ``jax.custom_vjp``: the forwards alone where not
    differentiated; differentiated, every forward and backward, the gradients kept as
    residuals and scaled by the loss's cotangent."""

    # Everything traced reaches the custom_vjp as an argument (a closed-over tracer would
    # leak out of an enclosing scan, e.g. the Trainer's gradient accumulation).
    @jax.custom_vjp
    def staged(
        stage_params: PyTree, head_params: PyTree, xs: jax.Array, ys: PyTree, sides: PyTree
    ) -> jax.Array:
        return _forwards_only(pipe, stage_params, head_params, xs, ys, sides)

    def forward(
        stage_params: PyTree, head_params: PyTree, xs: jax.Array, ys: PyTree, sides: PyTree
    ) -> tuple:
        return _with_grads(pipe, stage_params, head_params, xs, ys, sides)

    # The axes each primal varies over (static): the cotangents are typed as their primals.
    axes = jax.tree_util.tree_map(axes_of, (stage_params, head_params, xs))
    # Targets and side inputs are not differentiated: their cotangents are zeros.
    targets, side_types = (
        jax.tree_util.tree_map(lambda t: _Target(t.shape, t.dtype, axes_of(t)), tree)
        for tree in (ys, sides)
    )

    def backward(grads: tuple, cts: tuple) -> tuple:
        ct = cts[0]  # the aux is not differentiated
        # Scaled by the loss's cotangent, then summed over the axes a gradient varies over and
        # its primal does not (what jax.grad does for a value shared over an axis): the stage
        # axis for the head's params (the last stage's) and the input (stage 0's), a data
        # axis for params the caller did not make varying there.
        d = jax.tree_util.tree_map(lambda g, a: _typed_as((g * ct).astype(g.dtype), a), grads, axes)
        no_y, no_side = (
            jax.tree_util.tree_map(lambda t: t.zero(), tree) for tree in (targets, side_types)
        )
        return (*d, no_y, no_side)

    staged.defvjp(forward, backward)
    return staged(stage_params, head_params, xs, ys, sides)


class _Target:
    """A target leaf's shape, dtype and axes (not a pytree: a leaf of one)."""

    def __init__(self, shape: tuple, dtype: Any, axes: tuple) -> None:
        self.shape, self.dtype, self.axes = shape, dtype, axes

    def zero(self) -> Any:
        """Its zero cotangent (targets are not differentiated): float0 for integers."""
        if not jnp.issubdtype(self.dtype, jnp.inexact):
            return np.zeros(self.shape, jax.dtypes.float0)
        return cast_varying(jnp.zeros(self.shape, self.dtype), self.axes)


def _typed_as(g: jax.Array, axes: tuple) -> jax.Array:
    """``g`` summed over the axes it varies over that are not in ``axes``, then varying over
    every axis in ``axes``."""
    extra = tuple(sorted(set(axes_of(g)) - set(axes), key=str))
    if extra:
        g = lax.psum(g, extra)
    return cast_varying(g, axes)
