"""The host loop: :func:`fit` (steps, prefetch, evaluation, checkpoints, callbacks and
their actions, profiling) and :func:`evaluate` (exact means over any number of examples).

Host-side Python around the jitted programs of :mod:`jaxcoll.dp.step`. :func:`fit` *is*
``Trainer.fit`` (one signature and one list of options, here); ``Trainer.evaluate`` calls
:func:`evaluate` with its own evaluation program. The step metrics (time, throughput, FLOPs,
MFU, learning rate, memory) are computed in :mod:`jaxcoll.dp.metrics`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from .._core.typing import PyTree
from .._watch import handle_preemption, preemption_point
from .callbacks import Action, Callback, CallbackLike, as_callbacks, requested
from .checkpoint import Checkpointer
from .checks import check_state
from .data import Batches, leading_size
from .fit_args import (
    EvalData,
    check_data,
    check_profile,
    count,
    eval_sets,
    positive,
    total_steps,
)
from .metrics import Costs, StepMetrics, check_peak_flops, measure_peak_flops
from .state import TrainState


class Steps(Protocol):
    """What :func:`fit` uses of a :class:`~jaxcoll.dp.Trainer`."""

    def step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]: ...

    def shard_batch(self, batch: PyTree) -> PyTree: ...

    def evaluate(self, state: TrainState, data: Batches | Iterable[PyTree]) -> dict[str, float]: ...


def batch_source(data: Any, start: int) -> Callable[[int], PyTree]:
    """``source(s)``: global batch s, for s = start, start + 1, ... in turn.

    ``dp.Batches``: ``data[s]``; data that starts at any step (``data.iter_from(start)``,
    ``dp.TokenBatches``: grain's prefetching iterator from batch ``start``, whose state is
    the step); any other iterable: its batches after skipping the first ``start``."""
    if hasattr(data, "iter_from"):
        iterator = data.iter_from(start)
    elif hasattr(data, "__getitem__") and hasattr(data, "epoch"):
        return data.__getitem__
    else:
        iterator = iter(data)
        for _ in range(start):
            next(iterator)

    def source(_s: int) -> PyTree:
        try:
            return next(iterator)
        except StopIteration:
            raise ValueError(
                "Trainer.fit: data ran out of batches before steps= was reached."
            ) from None

    return source


# ------------------------------------------------------------------------------- evaluate
def _rows(batch: PyTree, lo: int, hi: int) -> PyTree:
    return jax.tree_util.tree_map(lambda a: a[lo:hi], batch)


def evaluate(
    metrics_of: Callable[[PyTree], dict[str, jax.Array]], data: Batches | Iterable[PyTree], n: int
) -> dict[str, float]:
    """The mean of every metric over every example of ``data``, exactly.

    ``metrics_of(batch)`` gives the global batch means of a batch whose size is a multiple of
    ``n`` (the device count). A batch of ``m`` examples is evaluated as its first
    ``m - m % n`` examples, then, if ``r = m % n`` are left, as those ``r`` examples given
    whole to every device (a batch of ``r * n``: each device's mean, and so the mean over
    devices, is the mean over the ``r``). Each part is weighted by its number of examples, so
    the result is the per-example mean over the whole data, for any metric that is a
    per-example mean.

    ``data``: an iterable of global batches, or a :class:`~jaxcoll.dp.Batches` (every
    example once, in order: :meth:`~jaxcoll.dp.Batches.in_order`).
    """
    check_data("Trainer.evaluate", "data", data)
    batches = data.in_order() if isinstance(data, Batches) else data
    parts: list[tuple[dict[str, jax.Array], int]] = []
    for batch in batches:
        size = leading_size("Trainer.evaluate", batch)
        full = size - size % n
        if full:
            parts.append((metrics_of(batch if full == size else _rows(batch, 0, full)), full))
        if size > full:
            rest = jax.tree_util.tree_map(
                lambda a: np.concatenate([np.asarray(a)] * n), _rows(batch, full, size)
            )
            parts.append((metrics_of(rest), size - full))
    if not parts:
        raise ValueError(
            "Trainer.evaluate: data yielded no batch; pass an iterable of "
            "global batches (or a dp.Batches)."
        )
    host = jax.device_get([m for m, _ in parts])  # one transfer for all batches
    count = sum(w for _, w in parts)
    return {
        name: sum(float(m[name]) * w for m, (_, w) in zip(host, parts)) / count for name in host[0]
    }


# ------------------------------------------------------------------------------------ fit
class Pending(NamedTuple):
    """A dispatched step whose outputs may not be ready yet."""

    step: int  # state.step after it
    examples: int
    metrics: dict[str, jax.Array]  # device arrays: the step's metrics and the learning rate
    costs: Costs  # its program's FLOPs and memory
    sent: tuple[float, float]  # when it was dispatched, and the step before it


def fit(
    trainer: Steps,
    state: TrainState,
    data: Batches | Iterable[PyTree],
    *,
    steps: int | None = None,
    epochs: int | None = None,
    eval_data: EvalData | None = None,
    eval_every: int | None = None,
    eval_on_start: bool = False,
    callbacks: CallbackLike | Iterable[CallbackLike] | None = None,
    checkpoint: Checkpointer | None = None,
    progress: bool | None = None,
    log_every: int = 10,
    prefetch: bool = True,
    tokens_per_example: int | None = None,
    peak_flops: float | str | None = None,
    profile_steps: tuple[int, int] | None = None,
    profile_dir: str | os.PathLike | None = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """``Trainer.fit(state, data, ...)``: train until ``state.step`` reaches ``steps`` (or
    ``epochs`` epochs of ``data``), or a callback asks to stop.

    ``data`` is a :class:`~jaxcoll.dp.Batches` (batch s is ``data[s]``, so a resumed run
    sees exactly the batches it would have) or any iterable of global batches (a resumed
    run skips the first ``state.step`` of them). With ``checkpoint``, the newest checkpoint
    in its directory that reads back is restored first (a damaged one is skipped with a
    warning), and the state is saved every ``checkpoint.every`` steps and at the end
    (orbax-checkpoint; ``every=None``: only when a callback asks): a run stopped at any point
    and started again with the same arguments ends bit-identical to one that was never
    stopped. With a checkpoint, SIGTERM (a preemption) stops every process after the same
    step, which is saved, and exits with code 143.

    Step numbers, everywhere (callbacks, history, ``profile_steps``): ``step`` is
    ``state.step`` after the update, 1 for the first step. Step s's metrics were computed on
    batch s - 1 with the params before its update; an evaluation at step s uses the params
    after s updates.

    Args:
        trainer: the :class:`~jaxcoll.dp.Trainer` (``self``: this function is its ``fit``).
        state: the state :meth:`Trainer.init` returned (or a later step's).
        data: the global batches, as above.
        steps: the total step count to reach (``state.step`` included: a resumed run takes
            the rest).
        epochs: the same in epochs of ``data`` (``epochs * len(data)`` steps); pass exactly
            one of ``steps`` and ``epochs``.
        eval_data: evaluated (:meth:`Trainer.evaluate`) every ``eval_every`` steps and at
            the end: batches (results ``loss``, ``accuracy``, ...), or named sets
            ``{"val": val_batches, "train": train_sample}``, each evaluated every time
            (results ``val_loss``, ``train_loss``, ...).
        eval_every: steps between evaluations (``len(data)``: once per epoch); None: at the
            end only.
        eval_on_start: also evaluate the state ``fit`` starts from (the initial state, or the
            restored one), before the first step: nanoGPT's evaluation at iteration 0, a
            baseline for the curves (Hugging Face's ``eval_on_start``). It is reported with
            ``step`` = ``state.step`` at the start (0 for a new run): a history entry of its
            own and ``on_eval(start, results)``.
        callbacks: :class:`~jaxcoll.dp.Callback` objects, metric writers with
            ``write_scalars(step, scalars)`` (``dp.JsonlWriter``, ``dp.TensorBoardWriter``,
            clu's) or functions ``fn(step, metrics)``: each gets every step's metrics and
            every evaluation's results as they happen (see :mod:`jaxcoll.dp.callbacks`), and
            may return a :class:`~jaxcoll.dp.Action` (save a checkpoint, stop).
        checkpoint: a :class:`~jaxcoll.dp.Checkpointer` (``dp.Checkpointer(directory,
            every=100)``); None: no checkpoints (a callback that asks to save is then an
            error: at the start for one with ``asks_to_save``, such as ``dp.SaveBest``,
            else at its request).
        progress: a tqdm bar; None (default): only when stderr is a terminal.
        log_every: steps between updates of the bar's loss.
        prefetch: build and place batch s+1 while step s runs (at most two steps in
            flight); False: one step at a time, each waited for before the next batch.
        tokens_per_example: tokens in one example (a sequence's length): adds
            ``tokens_per_s``.
        peak_flops: one device's peak FLOP/s, for ``mfu``; ``"measure"``:
            :func:`~jaxcoll.dp.measure_peak_flops` once at the start (printed, and kept as
            ``peak_flops`` in the first step's metrics); None: no ``mfu``.
        profile_steps: ``(start, stop)``: trace steps ``start`` to ``stop - 1`` with
            ``jax.profiler`` (waiting for them before the trace stops) into ``profile_dir``,
            for TensorBoard's profile plugin or Perfetto.
        profile_dir: the trace's directory (with ``profile_steps``).

    Returns:
        The final state and a history: one dict per step taken in this call with the step,
        the loss and the loss's metrics, and the step metrics (``step_time_s``,
        ``examples_per_s``, ``tokens_per_s``, ``flops_per_step``, ``mfu``, ``lr``,
        ``memory_bytes``: see :mod:`jaxcoll.dp.metrics`); at each evaluation, that step's
        dict also has ``eval_<key>`` for each key of the evaluation's results
        (``eval_loss``, or ``eval_val_loss`` for a named set).

    With ``prefetch``, step s is dispatched, then batch s+1 is built and placed (its host
    work and transfer overlap step s), then the loop waits for step s-1: at most two steps
    are in flight (XLA:CPU's in-process rendezvous can stall with many queued collective
    programs on few cores). The step metrics add no wait: they are read with the loss.
    """
    from tqdm.auto import tqdm

    api = "Trainer.fit"
    check_state(api, state)
    check_data(api, "data", data)
    sets = eval_sets(api, eval_data)
    total = total_steps(data, steps, epochs)
    eval_every = positive(
        api, "eval_every", eval_every, "number of steps (len(train_batches) for once per epoch)"
    )
    if not isinstance(eval_on_start, bool):
        raise TypeError(
            f"{api}: eval_on_start must be True or False, got {eval_on_start!r} of type "
            f"{type(eval_on_start).__name__} instead."
        )
    if eval_on_start and sets is None:
        raise ValueError(
            f"{api}: eval_on_start=True evaluates the starting state on eval_data, and fit "
            f"has no eval_data=; pass eval_data=val_batches (or named sets), or leave "
            f"eval_on_start=False."
        )
    cbs = as_callbacks(api, callbacks)
    if checkpoint is not None and not isinstance(checkpoint, Checkpointer):
        hint = (
            f" (a path: pass dp.Checkpointer({os.fspath(checkpoint)!r}, every=100))"
            if isinstance(checkpoint, (str, os.PathLike))
            else ""
        )
        raise TypeError(
            f"{api}: checkpoint must be a dp.Checkpointer(directory, every=...) "
            f"or None, got {type(checkpoint).__name__} instead{hint}."
        )
    savers = [type(cb).__name__ for cb in cbs if cb.asks_to_save]
    if checkpoint is None and savers:
        raise ValueError(
            f"{api}: the callback {savers[0]} asks to save checkpoints, and fit has no "
            f"checkpoint=; pass checkpoint=dp.Checkpointer(directory, every=None) (saves "
            f"only when a callback asks) or every=k (also every k steps and at the end)."
        )
    log_every = count(api, "log_every", log_every, "number of steps (between updates of the bar)")
    tokens_per_example = positive(
        api,
        "tokens_per_example",
        tokens_per_example,
        "int (the tokens of one example, e.g. the sequence length)",
    )
    peak = check_peak_flops(api, peak_flops)
    profile = check_profile(api, profile_steps, profile_dir)
    if progress is None:  # a bar only where someone watches it; not in logs or CI
        progress = sys.stderr.isatty()
    measured = None
    if peak == "measure":
        peak = measured = measure_peak_flops()
        if jax.process_index() == 0:
            print(
                f"{api}: measured peak {measured:.4g} FLOP/s per device "
                f"(dp.measure_peak_flops() on {jax.local_devices()[0]}); mfu is against it.",
                file=sys.stderr,
                flush=True,
            )
    assert peak is None or isinstance(peak, float)
    history: list[dict[str, Any]] = []
    bar = None
    tracing = False
    try:
        if checkpoint is not None:
            state = checkpoint.restore_latest(state)
        start = int(jax.device_get(state.step))
        source = batch_source(data, start)
        bar = tqdm(
            total=total, initial=start, disable=not progress, unit="step", dynamic_ncols=True
        )
        meter = StepMetrics(trainer, state, tokens_per_example=tokens_per_example, peak_flops=peak)
        asked = [Action(0)]  # what the callbacks asked since the loop last acted

        def ask(cb: Callback, hook: str, step: int, values: dict[str, float]) -> None:
            out = getattr(cb, hook)(step, dict(values))  # each callback its own copy
            asked[0] |= requested(api, cb, hook, out)

        def complete(p: Pending) -> None:
            # The step's outputs are available here (waiting for them if needed): the
            # metrics and the learning rate in one transfer.
            metrics = {k: float(v) for k, v in jax.device_get(p.metrics).items()}
            metrics.update(meter.complete(p.step, p.examples, p.costs, p.sent))
            if measured is not None and not history:
                metrics["peak_flops"] = measured
            history.append({"step": p.step, **metrics})
            for cb in cbs:
                ask(cb, "on_step", p.step, metrics)
            bar.update(1)
            if progress and (p.step % log_every == 0 or p.step == total):
                bar.set_postfix(loss=f"{metrics['loss']:.4f}")

        evaluated = [-1]

        def run_eval(at: int) -> None:
            assert sets is not None
            results: dict[str, float] = {}
            for prefix, batches in sets:
                for k, v in trainer.evaluate(state, batches).items():
                    results[prefix + k] = v
            evaluated[0] = at
            if history and history[-1]["step"] == at:
                history[-1].update({f"eval_{k}": v for k, v in results.items()})
            else:
                history.append({"step": at, **{f"eval_{k}": v for k, v in results.items()}})
            for cb in cbs:
                ask(cb, "on_eval", at, results)
            meter.restart()  # the evaluation's time (its callbacks' too) is not the next step's

        inflight: list[Pending] = []  # the step dispatched but not yet reported, if any

        def settle() -> None:
            """Report the step in flight (waiting for it): the state is then the last one
            reported, as an evaluation, a save or the end of a trace need."""
            while inflight:
                complete(inflight.pop())

        saved = [-1]

        def save(at: int) -> None:
            if checkpoint is None:
                raise RuntimeError(
                    f"{api}: a callback returned dp.Action.SAVE at step {at}, and fit has no "
                    f"checkpoint=; pass checkpoint=dp.Checkpointer(directory, every=None) "
                    f"(saves only when a callback asks), or do not return Action.SAVE."
                )
            if saved[0] != at:
                settle()  # the save waits for the state anyway; the step's time stays its own
                checkpoint.save(state)
                saved[0] = at
                meter.restart()

        def act(at: int) -> bool:
            """Do what the callbacks asked (the state is after step ``at``); True: stop."""
            action, asked[0] = asked[0], Action(0)
            if Action.SAVE in action:
                save(at)
            return Action.STOP in action

        def fetch(s: int) -> tuple[PyTree, int]:
            batch = source(s)
            return trainer.shard_batch(batch), leading_size("Trainer.step", batch)

        if eval_on_start:  # the state fit starts from, before any step (nanoGPT's iter 0)
            run_eval(start)
            if act(start):
                total = start  # a callback asked to stop: no step, the end runs as usual
        upcoming = fetch(start) if start < total else None
        last = start  # state.step of the newest state
        # With checkpoints, SIGTERM (a preemption) stops every process after the same step,
        # which is saved; without, it ends the process at once (jaxcoll's default).
        preemptible = handle_preemption() if checkpoint is not None else contextlib.nullcontext()
        with preemptible:
            for s in range(start, total):
                if profile is not None and not tracing and profile[0] <= s + 1 < profile[1]:
                    jax.profiler.start_trace(profile[2])  # before step profile[0] is dispatched
                    tracing = True
                batch, size = upcoming if upcoming is not None else fetch(s)
                if inflight:  # done already? (a look, no wait): then that is when it ended
                    meter.poll(inflight[-1].step, inflight[-1].metrics)
                state, metrics = trainer.step(state, batch)  # each step is dispatched here
                sent = meter.dispatched()
                last = s + 1
                costs = meter.costs(s, state, batch)  # once per program: a cache lookup
                metrics = {**metrics, **meter.device_values(state)}
                if checkpoint is not None and preemption_point(s + 1):
                    _preempted(api, checkpoint, state, s + 1)
                if checkpoint is not None:  # a save 2 steps back is committed by now
                    checkpoint.at_step(s + 1)
                upcoming = fetch(s + 1) if prefetch and s + 1 < total else None
                settle()  # waits for the step before: at most 2 in flight
                inflight.append(Pending(s + 1, size, metrics, costs, sent))
                if not prefetch:  # one step at a time: wait for it before building the next batch
                    settle()
                if tracing and profile is not None and s + 1 >= profile[1] - 1:
                    settle()  # the trace holds the profiled steps whole
                    jax.profiler.stop_trace()
                    tracing = False
                    meter.restart()
                if checkpoint is not None and checkpoint.every and (s + 1) % checkpoint.every == 0:
                    save(s + 1)
                if sets is not None and eval_every and (s + 1) % eval_every == 0:
                    settle()
                    run_eval(s + 1)
                if act(s + 1):
                    break
        settle()
        if tracing:
            jax.profiler.stop_trace()
            tracing = False
        final = max(start, last)
        act(final)  # a STOP here changes nothing: the loop is over
        if checkpoint is not None and checkpoint.every is not None:
            save(final)
        if sets is not None and evaluated[0] != final:
            run_eval(final)
            act(final)
        for cb in cbs:
            cb.on_end(final, history)
    finally:  # a crash keeps only the periodic checkpoints, as a killed process would
        if tracing:
            jax.profiler.stop_trace()
        if bar is not None:
            bar.close()
        if checkpoint is not None:
            checkpoint.close()
    return state, history


def _preempted(api: str, ckpt: Checkpointer, state: TrainState, step: int) -> None:
    """Save ``state`` (after ``step``) and end the process as a preempted one: exit 143."""
    ckpt.save(state)
    ckpt.wait()
    print(
        f"{api}: SIGTERM: saved a checkpoint at step {step} in {ckpt.directory}; exiting "
        f"with code {128 + signal.SIGTERM}. Start the same run again to resume there.",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(128 + signal.SIGTERM)
