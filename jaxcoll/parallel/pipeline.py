"""Pipeline parallelism on send/recv, by GPipe, 1F1B, interleaved 1F1B and ZB-H1 schedules:
micro-batches flow forward through the stages of a pipeline mesh axis, cotangents flow back,
gradients accumulate over micro-batches.

Seed 003 names pipelines as what send/recv are for; here every transfer is one
:func:`jaxcoll.primitives.sendrecv` (one ``lax.ppermute``) between neighbouring stages. This
module holds the primitive, :func:`pipeline_value_and_grad` (it owns the step: the loss and
this stage's gradient), what it shares with :func:`~jaxcoll.parallel.pipeline_loss` (the stage
axis and the schedule a call names or the layout in force gives, the batch cut into
micro-batches) and :func:`lower`, which picks a schedule's lowering: GPipe's and 1F1B's in
:mod:`._lockstep`, the interleaved schedule's in :mod:`._interleaved`, ZB-H1's in
:mod:`._zero_bubble`; what they share (micro-batches, a stage's checks and types, GPipe's
forward) is in :mod:`._stages`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp

from .. import primitives
from .._core import roles
from .._core.axis import bound
from .._core.roles import Role
from .._core.typing import PyTree
from .._core.vma import cast_varying
from . import _interleaved, _zero_bubble
from ._lockstep import _gpipe, _one_f_one_b
from ._lowering import Staged, aux_zeros
from ._stages import (
    MicroBatches,
    _carried,
    _check_side,
    _check_stage,
    _check_targets,
    _microbatches,
    in_place,
)
from .schedules import SCHEDULES, GPipe, Interleaved, Schedule, ZeroBubble

_VALUES = (
    "parallel.GPipe(M), parallel.OneFOneB(M), parallel.Interleaved(M, virtual=v) or "
    "parallel.ZeroBubble(M)"
)


def resolve_axis(axis_name: Hashable | None) -> Any:
    """The mesh axis ``axis_name`` stands for here: a role's (``Role.PIPELINE``) is the layout
    in force's axis for it (None where the layout gives it none), as a plain name."""
    return _plain(roles.axis(axis_name))


def _plain(name: Any) -> Any:
    """A role as its plain name (``"pipeline"``); any other name as it is."""
    return name.value if isinstance(name, Role) else name


def _value_spelling(name: str) -> str:
    """The schedule value that replaces a schedule's name, as code: ``OneFOneB(M)``."""
    cls = SCHEDULES[name]
    return f"{cls.__name__}(M, virtual=v)" if cls is Interleaved else f"{cls.__name__}(M)"


def check_schedule(api: str, schedule: Any) -> Schedule:
    """``schedule`` if it is a schedule value; else TypeError, naming the value to pass for a
    schedule's name (``"1f1b"``) or class."""
    if isinstance(schedule, Schedule):
        return schedule
    names = {**SCHEDULES, **{cls.__name__.lower(): cls for cls in SCHEDULES.values()}}
    if isinstance(schedule, str) and schedule.lower() in names:
        name = names[schedule.lower()].name
        chunks = ", v the model chunks per stage" if name == Interleaved.name else ""
        raise TypeError(
            f"{api}: schedule={schedule!r} is gone; pass a schedule value: "
            f"schedule=parallel.{_value_spelling(name)}, M its micro-batches per step{chunks} "
            f"(e.g. schedule=parallel.{SCHEDULES[name].__name__}(8))."
        )
    hint = (
        f" (the class: pass an instance with its micro-batches, parallel.{schedule.__name__}(8))"
        if isinstance(schedule, type) and issubclass(schedule, Schedule)
        else ""
    )
    raise TypeError(
        f"{api}: schedule must be a schedule value ({_VALUES}), got {schedule!r}{hint}."
    )


def resolve_schedule(api: str, schedule: Any, dense: bool) -> Schedule:
    """``schedule``, or the layout in force's where it is None; where neither gives one, the
    batch whole (``GPipe(1)``) in ``dense`` mode, else TypeError."""
    if schedule is None:
        schedule = roles.schedule()
    if schedule is None and dense:
        return GPipe(1)
    if schedule is None:
        raise TypeError(
            f"{api}: no schedule is given, and no layout in force has one; pass schedule= "
            f"({_VALUES}) or give the Trainer's layout one "
            f"(dp.Layout(pipeline=..., schedule=parallel.OneFOneB(M)))."
        )
    return check_schedule(api, schedule)


def split_batch(api: str, x: jax.Array, y: PyTree, schedule: Schedule) -> tuple[jax.Array, PyTree]:
    """``x`` and every leaf of ``y`` as ``schedule``'s M micro-batches, in place (``(B // M,
    M, ...)``: micro-batch m is rows m::M, as a Trainer's ``accum_steps`` cuts them), ``y``
    checked to hold one row per example of ``x``."""
    xs = _microbatches(api, x, schedule)
    _check_targets(api, x.shape[0], y)
    return xs, jax.tree_util.tree_map(lambda t: _microbatches(api, t, schedule), y)


def split_side(api: str, x: jax.Array, side: PyTree, schedule: Schedule) -> PyTree:
    """Every leaf of the side inputs ``side`` as ``schedule``'s micro-batches as ``x`` is
    (:func:`split_batch`), checked to hold one row per example of ``x``; None (no side
    inputs) stays None."""
    if side is None:
        return None
    _check_side(api, x.shape[0], side)
    return jax.tree_util.tree_map(lambda t: _microbatches(api, jnp.asarray(t), schedule), side)


def _headless(loss_fn: Callable) -> Callable:
    """``(out, y) -> loss`` as the schedules call a loss: ``(head, out, y) -> loss``."""
    return lambda head, out, y: loss_fn(out, y)


def lower(
    api: str,
    schedule: Schedule,
    stage_fn: Callable,
    loss_fn: Callable,
    own: PyTree,
    xs: jax.Array,
    ys: PyTree,
    stage_axis: Hashable,
    head: PyTree = (),
    *,
    sides: PyTree = None,
    has_aux: bool = False,
) -> tuple[jax.Array, PyTree, PyTree, jax.Array, tuple]:
    """Run ``schedule`` (its checks against the stages made): ``loss_fn`` is
    ``(head, out, y) -> mean loss``; ``own``: this stage's params (leading axis v for
    :class:`Interleaved`); ``xs``, ``ys``: the inputs and targets as :func:`split_batch`
    gives them (``(B // M, M, ...)``: micro-batch m is rows m::M, read in place); ``sides``:
    the side inputs as :func:`split_side` gives them, or None;
    ``has_aux``: ``stage_fn`` returns ``(h, (loss_term, aux))``. Returns the last stage's mean
    loss, this stage's gradient, the head's and the inputs', and ``(terms, auxs)``: this
    stage's loss terms summed over micro-batches and its aux per micro-batch (leading axis M;
    ``()`` without aux). The inputs' gradient is laid out as ``xs``."""
    # Staged reads xs as (M, mb, ...) by index and shape: MicroBatches reads it in place.
    xs_in, sides = MicroBatches(xs), in_place(sides)
    p = Staged(stage_fn, loss_fn, own, xs_in, ys, stage_axis, head, sides, has_aux)
    s = primitives.rank(stage_axis)
    if isinstance(schedule, Interleaved):
        if has_aux:
            raise ValueError(
                f"{api}: has_aux=True runs under GPipe, OneFOneB and ZeroBubble, not yet "
                f"{schedule!r}; pass schedule=parallel.OneFOneB({schedule.microbatches}) or "
                f"parallel.ZeroBubble({schedule.microbatches}) (the layers then unreshaped, "
                f"one chunk per stage)."
            )
        first = jax.tree_util.tree_map(lambda q: q[0], own)
        n_stages = primitives.world_size(stage_axis)
        check = lambda: _check_stage(api, stage_fn, first, xs_in, sides)  # noqa: E731
        _interleaved.check_runs(api, check, own, schedule.virtual, n_stages)
        act = _carried(stage_fn, first, xs_in, s, sides)
        return (*_interleaved.interleaved(p, schedule.virtual, act), aux_zeros(p, act))
    if isinstance(schedule, ZeroBubble):
        _check_stage(api, stage_fn, own, xs_in, sides, has_aux)
        n_stages = primitives.world_size(stage_axis)
        rows, keep = schedule.table(n_stages), schedule.kept_inputs(n_stages)
        act = _carried(stage_fn, own, xs_in, s, sides, has_aux)
        return _zero_bubble.zero_bubble(p, rows, keep, act)
    return (_gpipe if isinstance(schedule, GPipe) else _one_f_one_b)(api, p)


def pipeline_value_and_grad(
    stage_fn: Callable[..., jax.Array],
    loss_fn: Callable[[jax.Array, PyTree], jax.Array],
    params: PyTree,
    x: jax.Array,
    y: PyTree,
    *,
    axis_name: Hashable = Role.PIPELINE,
    schedule: Schedule | None = None,
    data_axis_name: Hashable | None = None,
    side: PyTree = None,
) -> tuple[jax.Array, PyTree]:
    """The loss of a staged model and this stage's gradient, by a GPipe, 1F1B, interleaved
    1F1B or ZB-H1 schedule (a :mod:`~jaxcoll.parallel.schedules` value:
    ``schedule=parallel.OneFOneB(8)``): the pipeline primitive, which owns the step.

    Call inside ``jax.shard_map`` over a mesh with a stage axis ``axis_name`` (stage s holds
    the params of stage s, e.g. ``in_specs=P("stage")`` on params stacked by stage) and
    optionally a data axis ``data_axis_name`` (each replica gets its part of the batch). For a
    loss that ``jax.grad`` or a ``dp.Trainer`` differentiates, the same schedules run behind
    :func:`~jaxcoll.parallel.pipeline_loss`. Equivalent to (one device)::

        def model_loss(all_params, x, y):
            for s in range(S):
                x = stage_fn(all_params[s], x)
            return loss_fn(x, y)         # a MEAN over the examples
        loss, grads = jax.value_and_grad(model_loss)(all_params, x_global, y_global)
        return loss, grads[stage]

    and with ``schedule=Interleaved(M, virtual=v)``, for a model of S*v chunks
    of which stage s holds chunks s, s + S, ..., s + (v - 1)S (``params`` stacks them on a
    leading axis of v: ``params[c]`` is model chunk ``c*S + s``)::

        def model_loss(chunks, x, y):    # chunks[k]: model chunk k
            for k in range(S * v):
                x = stage_fn(chunks[k], x)
            return loss_fn(x, y)
        loss, grads = jax.value_and_grad(model_loss)(chunks, x_global, y_global)
        return loss, stack([grads[c * S + stage] for c in range(v)])

    The replica's batch splits into M micro-batches, micro-batch i its rows i::M (read in
    place, as a ``dp.Trainer``'s ``accum_steps`` cuts its micro-batches: a replica's rows
    i::M are its share of the global rows i::M); every transfer between neighbouring
    stages is one ``sendrecv`` (one ``lax.ppermute``). A backward recomputes the stage's
    forward from its saved input (re-materialisation, as GPipe does: only stage inputs are
    kept), sends the input cotangent to stage s - 1 and adds the parameter gradient to the
    stage's sum over the M micro-batches. The last stage takes ``loss_fn`` of each micro-batch.

    * ``schedule=GPipe(M)``: forward, at step t stage s runs micro-batch t - s and sends its
      activation to stage s + 1 (M + S - 1 steps); then backward, in reverse, M + S - 1 steps.
      Every stage keeps all M micro-batches' inputs: activation memory grows with M.
    * ``schedule=OneFOneB(M)`` (one forward, one backward; PipeDream-flush, Megatron's
      non-interleaved schedule): 2(M + S - 1) slots; in slot t stage s runs

      - the forward of micro-batch ``i = (t - s) / 2`` when ``t - s`` is even,
      - the backward of micro-batch ``j = (t - 2S + 1 + s) / 2`` when ``t - s`` is odd,

      and nothing where that index is outside ``0..M-1``. So stage s makes S - 1 - s
      warm-up forwards, then alternates, then drains; the last stage runs micro-batch i's
      backward right after its forward. After each slot one ``sendrecv`` moves every
      forward's activation to s + 1 and every backward's cotangent to s - 1 (even slots pair
      stages 0-1, 2-3, ...; odd slots 1-2, 3-4, ...): the activation of micro-batch i leaves
      stage s in slot s + 2i and is used in slot s + 1 + 2i. Micro-batch i's input lives on
      stage s from slot s + 2i to its backward in slot 2S - 1 - s + 2i: at most S - s at
      once, kept in a buffer of ``min(S, M)`` micro-batches indexed i mod min(S, M).
      Activation memory is bounded by the number of stages, not M. Each slot a stage runs
      only its own branch (a ``lax.cond``), so the compute is GPipe's: M forwards and M
      recomputed forwards with their backwards.
    * ``schedule=Interleaved(M, virtual=v)`` (Megatron's interleaved 1F1B, virtual pipeline
      stages; M a multiple of S when v > 1): a micro-batch goes round the ring of stages v
      times, from stage S - 1 back to stage 0 between chunks. Each stage runs Mv forwards and Mv
      backwards of one chunk each, in groups of S micro-batches: forward entry n is chunk
      ``(n mod Sv) div S`` of micro-batch ``(n div Sv)S + n mod S`` (chunk 0 of the group's
      S micro-batches, then chunk 1 of the same, ...), backward entry n the same with the
      chunks from v - 1 down. ``Mv + (v + 1)S - 2`` rounds; in round k stage s runs

      - forward entry ``k - s``, then one ``sendrecv`` moves every activation one stage up
        the ring (S - 1 to 0: into the next chunk),
      - backward entry ``k - (v + 1)S + 2 + s``, then one ``sendrecv`` moves every cotangent
        one stage down the ring (0 to S - 1: into the previous chunk),

      each where that entry is in ``0..Mv-1`` (a ``lax.cond`` per half: the forward or the
      backward, or nothing). So an activation made in round k is used in round k + 1, the
      last stage runs the last chunk's backward in the round of its forward, the forwards
      start back to back (stage s makes vS + S - 1 - 2s of them before its first backward:
      Megatron's warm-up and its first steady forward) and the steady state alternates, as
      in Megatron's schedule. A chunk input lives from its forward to its backward: at most
      ``min(Mv, vS + S - 1)`` at once (on stage 0), kept in that many buffers taken from a
      free list. Activation memory is bounded by S and v, not M (more than 1F1B's S inputs;
      each is one chunk's input).
    * ``schedule=ZeroBubble(M)`` (ZB-H1): each backward split into B (the input's gradient)
      and W (the params'), the W's moved into 1F1B's bubble; the slots are
      :meth:`~jaxcoll.parallel.ZeroBubble.table`'s, one ``sendrecv`` each.

    The bubble (``schedule.bubble_fraction(S)``) is ``(S - 1) / (M + S - 1)`` for GPipe and
    1F1B and ``(S - 1) / (vM + S - 1)`` for the interleaved schedule, in slots of one chunk
    (1/v of a stage's work): Megatron's bubble, for v times the transfers. With
    ``data_axis_name`` the gradient is then averaged over the replicas by one all-reduce
    (exactly once: params are made varying over the axes first, so ``jax.vjp`` adds no hidden
    reduction; see the gradient trap in docs/dp.md).

    **Side inputs.** ``side`` (a pytree of per-example arrays: positions, segment ids,
    attention masks) is cut into the same micro-batches as ``x``, and every stage calls
    ``stage_fn(stage_params, h, side_microbatch)`` with the micro-batch it runs (every stage
    holds the replica's whole batch, so nothing crosses between stages for it). Side inputs
    are not differentiated: integer ones work, and a float one gets no gradient (it is
    treated as a constant, like ``jax.lax.stop_gradient`` of it).

    Args:
        stage_fn: ``(stage_params, h) -> h``, or ``(stage_params, h, side) -> h`` when
            ``side`` is given (one chunk's params with :class:`Interleaved`); every stage keeps
            the activation's shape and dtype (one program runs every stage: pad to one width
            if stages differ).
        loss_fn: ``(h_last, y_microbatch) -> scalar``, the MEAN loss over the micro-batch.
        params: this stage's parameters (a pytree); with :class:`Interleaved`, this stage's v
            chunks stacked on a leading axis of v (also for v = 1).
        x: this replica's input batch ``(B, ...)``, read by stage 0 (the others may pass the
            same array; only its shape is used there).
        y: this replica's targets, leading axis B (a pytree, every leaf one row per example
            of ``x``), read by the last stage.
        axis_name: the mesh axis of the stages, or the role ``Role.PIPELINE`` (the
            default): inside a ``dp.Trainer`` the layout's pipeline axis, elsewhere the mesh
            axis named ``"pipeline"``.
        schedule: a :class:`~jaxcoll.parallel.GPipe`, :class:`~jaxcoll.parallel.OneFOneB`,
            :class:`~jaxcoll.parallel.Interleaved` or :class:`~jaxcoll.parallel.ZeroBubble`
            value, with its M micro-batches (M must divide B; a multiple of S for
            ``Interleaved`` with v > 1); the same loss and gradients whichever it is.
            Default: the schedule of the layout in force (``dp.Layout(schedule=...)``).
        data_axis_name: the mesh axis of data-parallel replicas, or None.
        side: this replica's side inputs (a pytree, every leaf one row per example of ``x``),
            handed to every stage micro-batch by micro-batch; None (the default): none, and
            ``stage_fn`` takes two arguments.

    Returns:
        ``(loss, grads)``: the global mean loss (the same on every device) and this stage's
        gradient averaged over the replicas (leading axis v with :class:`Interleaved`).

    Raises:
        ValueError: M not dividing B or (interleaved, v > 1) not a multiple of S, params
            without the leading axis of v, a stage that changes the activation's shape, a
            stage axis not bound here, a leaf of ``side`` without one row per example.
        TypeError: ``schedule`` not a schedule value (a schedule's name, ``"1f1b"``: the
            message names the value to pass, ``parallel.OneFOneB(M)``), or none given.

    Example (2 data x 4 stages): see ``examples/06_pipeline.py``.
    """
    api = "pipeline_value_and_grad"
    sched = resolve_schedule(api, schedule, dense=False)
    xs, ys = split_batch(api, x, y, sched)
    sides = split_side(api, x, side, sched)
    stage_axis = resolve_axis(axis_name)
    if stage_axis is None or not bound(api, stage_axis, "axis_name"):
        shown = _plain(axis_name) if stage_axis is None else stage_axis
        raise ValueError(
            f"{api}: axis_name={shown!r} is not a mesh axis bound here (no jax.shard_map "
            f"binds it, or the layout in force gives the pipeline none). Call it inside "
            f"jax.shard_map over a mesh with that axis; parallel.pipeline_loss runs the "
            f"dense model where none is bound."
        )
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    # Varying over every axis first: jax.vjp then gives this device's own contribution, and
    # the one reduction over data below is the only one.
    axes = (stage_axis,) + ((data_axis_name,) if data_axis_name is not None else ())
    own = jax.tree_util.tree_map(lambda p: cast_varying(p, axes), params)
    if isinstance(sched, Interleaved):
        sched.check(api, n_stages)
        _interleaved.check_chunks(api, params, sched.virtual, stages=n_stages)
    last_loss, grads, _, _, _ = lower(
        api, sched, stage_fn, _headless(loss_fn), own, xs, ys, stage_axis, sides=sides
    )

    loss = primitives.all_reduce(jnp.where(s == n_stages - 1, last_loss, 0.0), stage_axis)
    if data_axis_name is not None:
        # Gradients cross the data replicas here, once: the mean of the replicas' means.
        grads = primitives.all_reduce(grads, data_axis_name, "avg")
        loss = primitives.all_reduce(loss, data_axis_name, "avg")
    return loss, grads
