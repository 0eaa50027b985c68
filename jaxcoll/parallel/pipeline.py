"""Pipeline parallelism on send/recv, GPipe, 1F1B and interleaved 1F1B schedules:
micro-batches flow forward through the stages of a ``stage`` mesh axis, cotangents flow back,
gradients accumulate over micro-batches.

Seed 003 names pipelines as what send/recv are for; here every transfer is one
:func:`jaxcoll.primitives.sendrecv` (one ``lax.ppermute``) between neighbouring stages. The
interleaved schedule's index formulas and lowering live in :mod:`._interleaved`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import primitives
from .._core.axis import bound
from .._core.typing import PyTree
from .._core.vma import cast_varying, varying_axes
from . import _interleaved, _zero_bubble
from ._lowering import Staged
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
        rows = schedule.table(primitives.world_size(stage_axis))
        return _zero_bubble.zero_bubble(p, rows, _carried(stage_fn, own, xs, s))
    return (_gpipe if isinstance(schedule, GPipe) else _one_f_one_b)(api, p)


def _unpack(p: Staged) -> tuple:
    return p.stage_fn, p.loss_fn, p.own, p.xs, p.ys, p.stage_axis, p.head


def _check_count(api: str, m: Any) -> None:
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"{api}: num_microbatches={m!r} must be a positive int.")


def _names(*trees: Any) -> tuple:
    """Every mesh axis any leaf of ``trees`` varies over (shard_map's types), sorted."""
    out: set = set()
    for leaf in jax.tree_util.tree_leaves(trees):
        out |= set(varying_axes(leaf) or ())
    return tuple(sorted(out, key=str))


def _microbatches(api: str, x: jax.Array, m: int, schedule: Schedule | None = None) -> jax.Array:
    _check_count(api, m)
    if x.ndim == 0 or x.shape[0] % m:
        into = f"num_microbatches={m}" if schedule is None else f"the {m} of {schedule!r}"
        raise ValueError(
            f"{api}: the batch has {x.shape[0] if x.ndim else 0} examples, which "
            f"do not split into {into} equal micro-batches. Pick a "
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


def _check_stage(api: str, stage_fn: Callable, params: PyTree, xs: jax.Array) -> None:
    # Typed as the schedule calls it: varying over every axis the params or inputs vary over.
    probe = jax.eval_shape(stage_fn, params, cast_varying(xs[0], _names(params, xs)))
    if (probe.shape, probe.dtype) != (xs.shape[1:], xs.dtype):
        raise ValueError(
            f"{api}: stage_fn maps a micro-batch of shape {xs.shape[1:]} "
            f"{xs.dtype} to {probe.shape} {probe.dtype}; every stage must keep the "
            f"activation's shape and dtype (one SPMD program runs every stage). "
            f"Pad or project the activations to one width."
        )


def _carried(stage_fn: Callable, params: PyTree, xs: jax.Array, s: jax.Array) -> tuple:
    """The axes the forward's activations vary over: the inputs' and the stage's, and those
    ``stage_fn``'s output varies over given such an input (a fixed point). A stage whose
    output is the same across a tensor axis (a Megatron block ends with its all-reduce)
    keeps it invariant there, so the model's output is too."""
    names = set(_names(xs, s))
    while True:
        probe = jax.eval_shape(stage_fn, params, cast_varying(xs[0], tuple(sorted(names, key=str))))
        grown = names | set(varying_axes(probe) or ())
        if grown == names:
            return tuple(sorted(names, key=str))
        names = grown


def _forward(
    api: str, stage_fn: Callable, params: PyTree, xs: jax.Array, stage_axis: Hashable
) -> tuple[jax.Array, jax.Array]:
    """The forward schedule: at step t stage s runs micro-batch t - s. Returns each stage's
    saved inputs ``(M, mb, ...)`` and, on the last stage, the outputs."""
    n_stages = primitives.world_size(stage_axis)
    m = xs.shape[0]
    s = primitives.rank(stage_axis)
    _check_stage(api, stage_fn, params, xs)
    names = _carried(stage_fn, params, xs, s)
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
    if not bound(api, stage_axis, "stage_axis"):
        return stage_fn(params, x)
    _, outs = _forward(api, stage_fn, params, xs, stage_axis)
    last = primitives.world_size(stage_axis) - 1
    return primitives.broadcast(outs.reshape(x.shape), stage_axis, last)


def _gpipe(api: str, p: Staged) -> tuple[jax.Array, PyTree, PyTree, jax.Array]:
    """GPipe: all forwards (saving M stage inputs), then all backwards. ``loss_fn`` is
    ``(head, out, y) -> mean loss``. Returns the last stage's mean loss (garbage elsewhere),
    this stage's gradient summed over micro-batches of the mean loss, the gradient of
    ``head`` (the last stage's; zero elsewhere) and that of the inputs ``xs`` (stage 0's;
    zero elsewhere)."""
    stage_fn, loss_fn, own, xs, ys, stage_axis, head = _unpack(p)
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    m = xs.shape[0]
    saved, outs = _forward(api, stage_fn, own, xs, stage_axis)

    # The last stage's are real.
    grad = jax.value_and_grad(loss_fn, argnums=(0, 1))
    losses, (d_heads, grads_out) = jax.vmap(grad, in_axes=(None, 0, 0))(head, outs, ys)
    grads_out = grads_out / m  # d(mean over micro-batches)/d(out)
    d_head = jax.tree_util.tree_map(
        lambda d: jnp.where(s == n_stages - 1, jnp.sum(d, 0) / m, jnp.zeros_like(d[0])), d_heads
    )
    backward = [(i + 1, i) for i in range(n_stages - 1)]
    names = _names(saved)  # the activations' axes, so their cotangents' too

    def step(carry, t):
        received, acc, d_xs = carry
        u = t - (n_stages - 1 - s)
        active = (u >= 0) & (u < m)
        k = jnp.clip(m - 1 - u, 0, m - 1)
        ct = jnp.where(s == n_stages - 1, grads_out[k], received)
        _, vjp = jax.vjp(stage_fn, own, saved[k])
        d_params, d_input = vjp(ct)
        acc = jax.tree_util.tree_map(
            lambda a, d: a + jnp.where(active, d, jnp.zeros_like(d)), acc, d_params
        )
        d_xs = d_xs.at[k].set(jnp.where(active & (s == 0), d_input, d_xs[k]))
        # <- the cotangent crosses back to the previous stage (send/recv: one ppermute)
        return (primitives.sendrecv(d_input, stage_axis, backward), acc, d_xs), None

    zero_ct = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), names)
    zeros = jax.tree_util.tree_map(
        lambda p: cast_varying(jnp.zeros(p.shape, p.dtype), _names(p)), own
    )
    d_xs0 = cast_varying(jnp.zeros(xs.shape, xs.dtype), names)
    (_, grads, d_xs), _ = lax.scan(step, (zero_ct, zeros, d_xs0), jnp.arange(m + n_stages - 1))
    return jnp.mean(losses), grads, d_head, d_xs


def _one_f_one_b(api: str, p: Staged) -> tuple[jax.Array, PyTree, PyTree, jax.Array]:
    """1F1B in lock-step slots: in slot t stage s runs the forward of micro-batch (t - s) / 2
    when t - s is even, the backward of micro-batch (t - 2S + 1 + s) / 2 when it is odd; after
    each slot one ``sendrecv`` moves every forward's activation to s + 1 and every backward's
    cotangent to s - 1. Stage inputs are kept in ``min(S, M)`` slots, micro-batch i in slot
    i mod min(S, M). Each slot a stage runs one branch of a ``lax.cond`` on its own
    predicate: a forward, or a recomputed forward and a backward, GPipe's work in another
    order. Returns what :func:`_gpipe` returns (``loss_fn`` as there)."""
    stage_fn, loss_fn, own, xs, ys, stage_axis, head = _unpack(p)
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    last = n_stages - 1
    m = xs.shape[0]
    _check_stage(api, stage_fn, own, xs)
    keep = min(n_stages, m)
    # Each value typed as what it holds: activations (and their cotangents) over the axes
    # the forward's do vary over (_carried), gradients as their params, the loss over those
    # of the activations, targets and head.
    act = _carried(stage_fn, own, xs, s)
    zero = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), act)
    saved0 = cast_varying(jnp.zeros((keep,) + xs.shape[1:], xs.dtype), act)
    zeros = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), _names(p)), own)
    loss0 = cast_varying(jnp.zeros((), jnp.float32), _names(zero, ys, head))
    head0 = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), _names(p)), head)
    d_xs0 = cast_varying(jnp.zeros(xs.shape, xs.dtype), act)
    template = (zero, saved0, zero, zeros, loss0, head0, d_xs0)
    # Slot t: stage s works forward iff t - s is even, so in an even slot the even stages send
    # forward and the odd ones back (pairs 0-1, 2-3, ...), in an odd slot the pairs 1-2, 3-4, ...
    even = [(i, i + 1) for i in range(0, last, 2)] + [(i, i - 1) for i in range(1, n_stages, 2)]
    odd = [(i, i + 1) for i in range(1, last, 2)] + [(i, i - 1) for i in range(2, n_stages, 2)]

    def typed(tree: PyTree) -> PyTree:
        """A branch's outputs typed as ``template`` (every branch of the switch alike)."""
        return jax.tree_util.tree_map(lambda v, r: cast_varying(v, _names(r)), tree, template)

    def slot(carry, t, pairs):
        received, own_ct, saved, acc, loss, acc_head, d_xs = carry
        forward = (t - s) % 2 == 0
        i = (t - s) // 2  # the forward's micro-batch
        j = (t - 2 * last - 1 + s) // 2  # the backward's micro-batch
        fi, bj = jnp.clip(i, 0, m - 1), jnp.clip(j, 0, m - 1)
        at_last = s == last

        # Each branch updates the state itself (no zero trees, no masked sums; measured in a
        # Trainer step, less memory than updating it after the switch): the idle slots of the
        # warm-up and drain compute nothing.
        def idle():
            return typed((zero, saved, own_ct, acc, loss, acc_head, d_xs))

        def run_forward():
            inp = jnp.where(s == 0, xs[fi], received)
            out = stage_fn(own, inp)
            y = jax.tree_util.tree_map(lambda v: v[fi], ys)
            # Used on the last stage only.
            value, (d_head, d_out) = jax.value_and_grad(loss_fn, argnums=(0, 1))(head, out, y)
            acc_head_new = jax.tree_util.tree_map(
                lambda a, d: a + jnp.where(at_last, d / m, jnp.zeros_like(d)), acc_head, d_head
            )
            own_ct_new = jnp.where(at_last, d_out / m, own_ct)
            loss_new = loss + jnp.where(at_last, value.astype(jnp.float32), 0.0)
            saved_new = saved.at[fi % keep].set(inp)
            return typed((out, saved_new, own_ct_new, acc, loss_new, acc_head_new, d_xs))

        def run_backward():
            ct = jnp.where(at_last, own_ct, received)
            _, vjp = jax.vjp(stage_fn, own, saved[bj % keep])
            d_params, d_input = vjp(ct)
            acc_new = jax.tree_util.tree_map(jnp.add, acc, d_params)
            d_xs_new = d_xs.at[bj].set(jnp.where(s == 0, d_input, d_xs[bj]))
            return typed((d_input, saved, own_ct, acc_new, loss, acc_head, d_xs_new))

        fwd = forward & (i >= 0) & (i < m)
        bwd = ~forward & (j >= 0) & (j < m)
        branch = jnp.where(fwd, 1, jnp.where(bwd, 2, 0))
        message, saved, own_ct, acc, loss, acc_head, d_xs = lax.switch(
            branch, (idle, run_forward, run_backward)
        )
        # -> activations to s + 1, <- cotangents to s - 1: one sendrecv (one ppermute)
        sent = primitives.sendrecv(message, stage_axis, pairs)
        return sent, own_ct, saved, acc, loss, acc_head, d_xs

    def step(carry, k):
        carry = slot(carry, 2 * k, even)
        return slot(carry, 2 * k + 1, odd), None

    carry = (zero, zero, saved0, zeros, loss0, head0, d_xs0)
    (_, _, _, grads, loss, d_head, d_xs), _ = lax.scan(step, carry, jnp.arange(m + n_stages - 1))
    return loss / m, grads, d_head, d_xs


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
