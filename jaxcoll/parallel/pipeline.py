"""Pipeline parallelism on send/recv, GPipe, 1F1B, interleaved 1F1B and ZB-H1 schedules:
micro-batches flow forward through the stages of a ``stage`` mesh axis, cotangents flow back,
gradients accumulate over micro-batches.

Seed 003 names pipelines as what send/recv are for; here every transfer is one
:func:`jaxcoll.primitives.sendrecv` (one ``lax.ppermute``) between neighbouring stages. This
module holds the public calls and :func:`lower`, which picks a schedule's lowering: GPipe's
and 1F1B's in :mod:`._lockstep`, the interleaved schedule's in :mod:`._interleaved`, ZB-H1's
in :mod:`._zero_bubble`; what they share (micro-batches, a stage's checks and types, GPipe's
forward) is in :mod:`._stages`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp

from .. import primitives
from .._core import roles
from .._core.axis import bound
from .._core.typing import PyTree
from .._core.vma import cast_varying
from . import _interleaved, _zero_bubble
from ._lockstep import _gpipe, _one_f_one_b
from ._lowering import Staged
from ._stages import (
    _carried,
    _check_count,
    _check_stage,
    _check_targets,
    _forward,
    _microbatches,
)
from .schedules import SCHEDULES, GPipe, Interleaved, Schedule, ZeroBubble

_SCHEDULES = tuple(SCHEDULES)


def _check_schedule(api: str, schedule: Any) -> str:
    if not isinstance(schedule, str) or schedule not in _SCHEDULES:
        hint = (
            f" (the class: pass an instance with its micro-batches, "
            f"parallel.{schedule.__name__}(8))"
            if isinstance(schedule, type) and issubclass(schedule, Schedule)
            else ""
        )
        raise ValueError(
            f"{api}: schedule={schedule!r} is not a pipeline schedule{hint}; expected a "
            f"schedule value, parallel.GPipe(M), parallel.OneFOneB(M) or "
            f"parallel.Interleaved(M, virtual=v) (or, deprecated, one of "
            f"{', '.join(repr(s) for s in _SCHEDULES)})."
        )
    return schedule


def bubble_fraction(
    num_stages: int, num_microbatches: int, schedule: str = "gpipe", *, virtual_stages: int = 1
) -> float:
    """The idle share of a stage's slots in :func:`pipeline_value_and_grad`'s schedule.

    A slot is one forward or one backward of one stage's model chunk (the whole stage when
    ``virtual_stages`` is 1). GPipe and 1F1B, as lowered here, take ``2(M + S - 1)`` slots per
    stage for S stages and M micro-batches, of which every stage is busy for ``2M`` (M
    forwards, M backwards): the bubble is ``(S - 1) / (M + S - 1)`` for either.

    * ``"gpipe"``: M + S - 1 forward steps, then M + S - 1 backward steps; stage s idles for
      S - 1 steps in each.
    * ``"1f1b"``: 2(M + S - 1) slots alternating forward and backward (stage s runs forwards in
      the slots of its parity); its warm-up and drain idle 2(S - 1) of them, as the classic
      non-interleaved 1F1B with a flush does.
    * ``"interleaved"`` with v = ``virtual_stages`` chunks per stage: 2(Mv + S - 1) slots of
      one chunk each (a 1/v-th of a stage's work), busy 2Mv, so the bubble is
      ``(S - 1) / (vM + S - 1)``: Megatron's interleaved bubble, (S - 1) / (vM) of the
      ideal compute. The schedule takes ``Mv + (v + 1)S - 2`` rounds of a forward half and a
      backward half; in the first vS - 1 rounds no stage has a backward and in the last
      vS - 1 none has a forward, so those halves are nobody's slots (every stage skips
      them; only their transfer runs). With v = 1 the bubble is 1F1B's.

    1F1B does not shrink the bubble; it bounds activation memory: a stage keeps at most
    ``min(S, M)`` micro-batches' inputs instead of GPipe's M. Interleaving divides the bubble
    by about v, for v times the transfers and ``min(Mv, vS + S - 1)`` kept chunk inputs.

    Args:
        num_stages: S.
        num_microbatches: M (a multiple of S when ``virtual_stages`` > 1).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        virtual_stages: v, model chunks per stage; more than 1 only with ``"interleaved"``.

    Example::

        >>> bubble_fraction(4, 8)
        0.2727272727272727
        >>> bubble_fraction(4, 8, schedule="1f1b")
        0.2727272727272727
        >>> bubble_fraction(4, 8, schedule="interleaved", virtual_stages=2)
        0.15789473684210525
    """
    api = "bubble_fraction"
    _check_schedule(api, schedule)
    v = _interleaved.check_virtual_stages(api, virtual_stages, schedule)
    _interleaved.check_groups(api, num_stages, num_microbatches, v)
    extra = f", virtual_stages={v}" if schedule == "interleaved" else ""
    warnings.warn(
        f"{api}({num_stages}, {num_microbatches}, {schedule!r}{extra}) is the old spelling; pass "
        f"parallel.{_value_spelling(schedule, num_microbatches, v)}.bubble_fraction("
        f"{num_stages}) (a schedule value, which pipeline_value_and_grad takes too).",
        DeprecationWarning,
        stacklevel=2,
    )
    slots = 2 * (num_microbatches * v + num_stages - 1)
    busy = 2 * num_microbatches * v
    return (slots - busy) / slots


def _value_spelling(schedule: str, m: Any, v: int) -> str:
    """The schedule value that replaces a string spelling, as code: ``OneFOneB(8)``."""
    cls = SCHEDULES[schedule].__name__
    return f"{cls}({m}, virtual={v})" if schedule == "interleaved" else f"{cls}({m})"


def _as_schedule(api: str, schedule: Any, num_microbatches: Any, virtual_stages: Any) -> Schedule:
    """The schedule value of either spelling: a :class:`Schedule`, or (deprecated) a string
    with ``num_microbatches`` and ``virtual_stages``."""
    if isinstance(schedule, Schedule):
        extra = [
            f"{k}={v!r}"
            for k, v in (("num_microbatches", num_microbatches), ("virtual_stages", virtual_stages))
            if v is not None
        ]
        if extra:
            raise TypeError(
                f"{api}: schedule={schedule!r} carries its micro-batches (and chunks); "
                f"drop {' and '.join(extra)}."
            )
        return schedule
    omitted = schedule is None
    if omitted:
        schedule = "gpipe"
    _check_schedule(api, schedule)
    if num_microbatches is None:
        raise TypeError(
            f"{api}: no micro-batch count: pass a schedule value, e.g. "
            f"schedule=parallel.OneFOneB(8) (or parallel.GPipe(8), parallel.Interleaved(8, "
            f"virtual=2))."
        )
    v = _interleaved.check_virtual_stages(
        api, 1 if virtual_stages is None else virtual_stages, schedule
    )
    _check_count(api, num_microbatches)
    spelled = (
        ("" if omitted else f"schedule={schedule!r}, ")
        + (f"num_microbatches={num_microbatches}")
        + (f", virtual_stages={v}" if virtual_stages is not None else "")
    )
    warnings.warn(
        f"{api}: {spelled} is the old spelling; pass "
        f"schedule=parallel.{_value_spelling(schedule, num_microbatches, v)} (a value that "
        f"also gives the schedule's bubble_fraction and kept_inputs).",
        DeprecationWarning,
        stacklevel=3,
    )
    if schedule == "interleaved":
        return Interleaved(num_microbatches, virtual=v)
    return SCHEDULES[schedule](num_microbatches)


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
) -> tuple[jax.Array, PyTree, PyTree, jax.Array]:
    """Run ``schedule`` (its checks against the stages made): ``loss_fn`` is
    ``(head, out, y) -> mean loss``; ``own``: this stage's params (leading axis v for
    :class:`Interleaved`). Returns the last stage's mean loss, this stage's gradient, the
    head's and the inputs'."""
    p = Staged(stage_fn, loss_fn, own, xs, ys, stage_axis, head)
    s = primitives.rank(stage_axis)
    if isinstance(schedule, Interleaved):
        first = jax.tree_util.tree_map(lambda q: q[0], own)
        _check_stage(api, stage_fn, first, xs)
        act = _carried(stage_fn, first, xs, s)
        return _interleaved.interleaved(p, schedule.virtual, act)
    if isinstance(schedule, ZeroBubble):
        _check_stage(api, stage_fn, own, xs)
        n_stages = primitives.world_size(stage_axis)
        rows, keep = schedule.table(n_stages), schedule.kept_inputs(n_stages)
        return _zero_bubble.zero_bubble(p, rows, keep, _carried(stage_fn, own, xs, s))
    return (_gpipe if isinstance(schedule, GPipe) else _one_f_one_b)(api, p)


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

    **Dense mode.** Where ``stage_axis`` is not bound (no enclosing ``jax.shard_map`` names
    it: a single-device reference run of the same model code), it returns
    ``stage_fn(params, x)``: pass ALL stages' params, e.g. layers stacked on a leading axis
    that ``stage_fn`` scans over, which the pipelined run splits over the stages
    (``P("stage")``) so that each stage scans its own. One model definition then serves both
    runs. "Not bound" is what jax 0.10 reports as ``NameError`` from
    ``lax.axis_size(stage_axis)``, under ``jax.jit`` or not; ``num_microbatches`` is checked
    against the batch in both modes.

    Lowering: the GPipe forward schedule of :func:`pipeline_value_and_grad` (a ``lax.scan``
    of M + S - 1 steps, one ``sendrecv`` each), then a broadcast from the last stage.
    Differentiable: ``jax.grad`` of a loss of the output (the same on every stage) gives
    each stage its own params' gradient, GPipe by autodiff (the scan's transpose runs the
    backward, the ``sendrecv`` transposes carry the cotangents down, the broadcast's
    hands the loss's cotangent to the last stage alone). Autodiff keeps every step's
    residuals, so memory grows with M; :func:`pipeline_value_and_grad` keeps less.

    .. warning::
        Under ``jax.shard_map(..., check_vma=False)`` jax tracks no replicated types, so
        ``jax.grad`` of a loss computed on every stage differentiates the sum of the S
        stages' copies: the gradients come out S times the model's (as for
        ``lax.psum``'s transpose there). Keep ``check_vma=True`` (the default).

    Example (4 devices as 4 stages, then none)::

        >>> stage = lambda w, h: h * jnp.prod(w)  # this stage's factors (all: dense)
        >>> f = jax.shard_map(lambda w, x: pipeline_apply(stage, w, x, stage_axis="stage",
        ...                   num_microbatches=2), mesh=mesh, in_specs=(P("stage"), P()),
        ...                   out_specs=P())
        >>> f(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.ones(4))
        Array([24., 24., 24., 24.], dtype=float32)
        >>> pipeline_apply(stage, jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.ones(4),
        ...                stage_axis="stage", num_microbatches=2)  # no shard_map: dense
        Array([24., 24., 24., 24.], dtype=float32)
    """
    api = "pipeline_apply"
    xs = _microbatches(api, x, num_microbatches)
    stage_axis = roles.axis(stage_axis)  # a role ("pipeline"): the layout's axis for it
    if stage_axis is None or not bound(api, stage_axis, "stage_axis"):
        return stage_fn(params, x)
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
    schedule: Schedule | str | None = None,
    data_axis: Hashable | None = None,
    num_microbatches: int | None = None,
    virtual_stages: int | None = None,
) -> tuple[jax.Array, PyTree]:
    """The loss of a staged model and this stage's gradient, by a GPipe, 1F1B or interleaved
    1F1B schedule (a :mod:`~jaxcoll.parallel.schedules` value:
    ``schedule=parallel.OneFOneB(8)``).

    Call inside ``jax.shard_map`` over a mesh with a ``stage_axis`` (stage s holds the params
    of stage s, e.g. ``in_specs=P("stage")`` on params stacked by stage) and optionally a
    ``data_axis`` (each replica gets its part of the batch). Equivalent to (one device)::

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

    The replica's batch splits into M micro-batches; every transfer between neighbouring
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

    The bubble (``schedule.bubble_fraction(S)``) is ``(S - 1) / (M + S - 1)`` for GPipe and
    1F1B and ``(S - 1) / (vM + S - 1)`` for the interleaved schedule, in slots of one chunk
    (1/v of a stage's work): Megatron's bubble, for v times the transfers. With ``data_axis`` the
    gradient is then averaged over the replicas by one all-reduce (exactly once: params are
    made varying over the axes first, so ``jax.vjp`` adds no hidden reduction; see the
    gradient trap in docs/dp.md).

    Args:
        stage_fn: ``(stage_params, h) -> h`` (one chunk's params with :class:`Interleaved`);
            every stage keeps the activation's shape and dtype (one program runs every stage: pad
            to one width if stages differ).
        loss_fn: ``(h_last, y_microbatch) -> scalar``, the MEAN loss over the micro-batch.
        params: this stage's parameters (a pytree); with :class:`Interleaved`, this stage's v
            chunks stacked on a leading axis of v (also for v = 1).
        x: this replica's input batch ``(B, ...)``, read by stage 0 (the others may pass the
            same array; only its shape is used there).
        y: this replica's targets, leading axis B (a pytree, every leaf one row per example
            of ``x``), read by the last stage.
        stage_axis: the mesh axis of the stages.
        schedule: a :class:`~jaxcoll.parallel.GPipe`, :class:`~jaxcoll.parallel.OneFOneB`
            or :class:`~jaxcoll.parallel.Interleaved` value, with its M micro-batches (M
            must divide B; a multiple of S for ``Interleaved`` with v > 1); the same loss and
            gradients whichever it is.
        data_axis: the mesh axis of data-parallel replicas, or None.
        num_microbatches: the former spelling of M, with ``schedule`` a string
            (``"gpipe"``, ``"1f1b"``, ``"interleaved"``) or omitted (GPipe): still accepted,
            with a DeprecationWarning naming the value that replaces it.
        virtual_stages: the former spelling of v, with ``schedule="interleaved"``.

    Returns:
        ``(loss, grads)``: the global mean loss (the same on every device) and this stage's
        gradient averaged over the replicas (leading axis v with :class:`Interleaved`).

    Raises:
        ValueError: an unknown schedule, M not dividing B or (interleaved, v > 1) not a
            multiple of S, params without the leading axis of v, a stage that changes the
            activation's shape.
        TypeError: a schedule value given ``num_microbatches`` or ``virtual_stages`` too, or
            a string without ``num_microbatches``.

    Example (2 data x 4 stages): see ``examples/06_pipeline.py``.
    """
    api = "pipeline_value_and_grad"
    sched = _as_schedule(api, schedule, num_microbatches, virtual_stages)
    m, v = sched.microbatches, sched.virtual
    xs = _microbatches(api, x, m, sched)
    _check_targets(api, x.shape[0], y)
    ys = jax.tree_util.tree_map(lambda t: _microbatches(api, t, m, sched), y)
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    # Varying over every axis first: jax.vjp then gives this device's own contribution, and
    # the one reduction over data below is the only one.
    axes = (stage_axis,) + ((data_axis,) if data_axis is not None else ())
    own = jax.tree_util.tree_map(lambda p: cast_varying(p, axes), params)
    if isinstance(sched, Interleaved):
        sched.check(api, n_stages)
        _interleaved.check_chunks(api, params, v)
    last_loss, grads, _, _ = lower(
        api, sched, stage_fn, _headless(loss_fn), own, xs, ys, stage_axis
    )

    loss = primitives.all_reduce(jnp.where(s == n_stages - 1, last_loss, 0.0), stage_axis)
    if data_axis is not None:
        # Gradients cross the data replicas here, once: the mean of the replicas' means.
        grads = primitives.all_reduce(grads, data_axis, "avg")
        loss = primitives.all_reduce(loss, data_axis, "avg")
    return loss, grads
