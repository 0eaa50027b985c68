"""One call of :meth:`Trainer.fit <jaxcoll.dp.Trainer.fit>`: the steps, prefetch, the
checkpoints, the callbacks and what they ask, and the components' hooks
(:mod:`jaxcoll.dp.loop.components`) at their places in the loop.

:func:`jaxcoll.dp.loop.fit.fit` checks its arguments and runs a :class:`Runner`; the step metrics
(time, FLOPs, memory, learning rate) are measured in :mod:`jaxcoll.dp.reports.metrics`.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from ..._core.typing import PyTree
from ..._watch import handle_preemption, preemption_point
from ..callbacks.base import Action, Callback, eval_keys, requested
from ..checkpoint.checkpointer import Checkpointer
from ..data.batches import leading_size
from ..reports.metrics import Costs, StepMetrics
from ..state import TrainState
from .components import Component, Steps

API = "Trainer.fit"


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
            raise ValueError(f"{API}: data ran out of batches before steps= was reached.") from None

    return source


class Pending(NamedTuple):
    """A dispatched step whose outputs may not be ready yet."""

    step: int  # state.step after it
    examples: int
    metrics: dict[str, jax.Array]  # device arrays: the step's metrics and the learning rate
    costs: Costs  # its program's FLOPs and memory
    sent: tuple[float, float]  # when it was dispatched, and the step before it


class Runner:
    """The loop of one ``fit``: :meth:`run` returns the final state and the history.

    It is the :class:`~jaxcoll.dp.loop.components.Loop` its components see: ``state`` (the newest
    state), ``step`` (its ``state.step``), :meth:`settle`, :meth:`report_eval` and
    :meth:`restart_clock`.
    """

    def __init__(
        self,
        trainer: Steps,
        state: TrainState,
        data: Any,
        total: int,
        callbacks: list[Callback],
        checkpoint: Checkpointer | None,
        prefetch: bool,
    ) -> None:
        self.trainer, self.state, self.data, self.total = trainer, state, data, total
        self.callbacks = callbacks
        self.components = [cb for cb in callbacks if isinstance(cb, Component)]
        self.checkpoint, self.prefetch = checkpoint, prefetch
        self.history: list[dict[str, Any]] = []
        self.asked = Action(0)  # what the callbacks asked since the loop last acted
        self.inflight: list[Pending] = []  # the step dispatched but not yet reported, if any
        self.saved = -1  # the step of the last save
        self.start = self.step = 0
        self.devices = 1

    # ------------------------------------------------------------------ what components use
    def settle(self) -> None:
        """Report the step in flight (waiting for it): the state is then the last one
        reported, as an evaluation, a save or the end of a trace need."""
        while self.inflight:
            self._complete(self.inflight.pop())

    def report_eval(self, at: int, results: dict[str, float]) -> None:
        """Evaluation results at step ``at``: into the history and to every ``on_eval``."""
        scored = eval_keys(results)
        if self.history and self.history[-1]["step"] == at:
            self.history[-1].update(scored)
        else:
            self.history.append({"step": at, **scored})
        for cb in self.callbacks:
            self._ask(cb, "on_eval", at, results)
        self.restart_clock()  # the evaluation's time (its callbacks' too) is not the next step's

    def restart_clock(self) -> None:
        self.meter.restart()

    # ------------------------------------------------------------------------------ the loop
    def run(self) -> tuple[TrainState, list[dict[str, Any]]]:
        try:
            self._begin()
            # With checkpoints, SIGTERM (a preemption) stops every process after the same
            # step, which is saved; without, it ends the process at once (jaxcoll's default).
            ckpt = self.checkpoint
            with handle_preemption() if ckpt is not None else contextlib.nullcontext():
                upcoming = self._fetch(self.start) if self.start < self.total else None
                for s in range(self.start, self.total):
                    upcoming, stop = self._turn(s, upcoming)
                    if stop:
                        break
            self._finish()
        finally:  # a crash keeps only the periodic checkpoints, as a killed process would
            for c in self.components:
                c.close()
            if self.checkpoint is not None:
                self.checkpoint.close()
        return self.state, self.history

    def _begin(self) -> None:
        if self.checkpoint is not None:
            self.state = self.checkpoint.restore_latest(self.state)
        self.start = self.step = int(jax.device_get(self.state.step))
        self.source = batch_source(self.data, self.start)
        self.meter = StepMetrics(self.trainer, self.state)
        self.devices = self.meter.n
        for c in self.components:
            c.on_fit_start(self)
        self.restart_clock()  # the first step's time starts here, compilation included
        if self._act(self.start):
            self.total = self.start  # a callback asked to stop: no step, the end runs as usual

    def _fetch(self, s: int) -> tuple[PyTree, int]:
        batch = self.source(s)
        return self.trainer.shard_batch(batch), leading_size("Trainer.step", batch)

    def _turn(
        self, s: int, upcoming: tuple[PyTree, int] | None
    ) -> tuple[tuple[PyTree, int] | None, bool]:
        """Step s + 1: dispatch it, build the next batch, report the step before; then the
        components, the periodic save and what the callbacks asked. True: stop."""
        ckpt, meter, step = self.checkpoint, self.meter, s + 1
        for c in self.components:
            c.before_step(self, step)
        batch, size = upcoming if upcoming is not None else self._fetch(s)
        if self.inflight:  # done already? (a look, no wait): then that is when it ended
            meter.poll(self.inflight[-1].step, self.inflight[-1].metrics)
        self.state, metrics = self.trainer.step(self.state, batch)  # dispatched here
        sent = meter.dispatched()
        self.step = step
        costs = meter.costs(s, self.state, batch)  # once per program: a cache lookup
        metrics = {**metrics, **meter.device_values(self.state)}
        if ckpt is not None and preemption_point(step):
            _preempted(ckpt, self.state, step)
        if ckpt is not None:  # a save 2 steps back is committed by now
            ckpt.at_step(step)
        upcoming = self._fetch(step) if self.prefetch and step < self.total else None
        self.settle()  # waits for the step before: at most 2 in flight
        self.inflight.append(Pending(step, size, metrics, costs, sent))
        if not self.prefetch:  # one step at a time: wait for it before building the next batch
            self.settle()
        for c in self.components:
            c.after_step(self, step)
        if ckpt is not None and ckpt.every and step % ckpt.every == 0:
            self._save(step)
        return upcoming, self._act(step)

    def _finish(self) -> None:
        self.settle()
        final = self.step
        for c in self.components:
            c.after_last_step(self, final)
        if self.checkpoint is not None and self.checkpoint.every is not None:
            self._save(final)
        self._act(final)  # a STOP here changes nothing: the loop is over
        for cb in self.callbacks:
            cb.on_end(final, self.history)

    # ------------------------------------------------------------------- reports and actions
    def _complete(self, p: Pending) -> None:
        # The step's outputs are available here (waiting for them if needed): the metrics
        # and the learning rate in one transfer.
        metrics = {k: float(v) for k, v in jax.device_get(p.metrics).items()}
        metrics.update(self.meter.complete(p.step, p.examples, p.costs, p.sent))
        for c in self.components:
            c.add_metrics(p.step, metrics, p.examples)
        self.history.append({"step": p.step, **metrics})
        for cb in self.callbacks:
            self._ask(cb, "on_step", p.step, metrics)

    def _ask(self, cb: Callback, hook: str, step: int, values: dict[str, float]) -> None:
        out = getattr(cb, hook)(step, dict(values))  # each callback its own copy
        self.asked |= requested(API, cb, hook, out)

    def _save(self, at: int) -> None:
        if self.checkpoint is None:
            raise RuntimeError(
                f"{API}: a callback returned dp.Action.SAVE at step {at}, and fit has no "
                f"checkpoint=; pass checkpoint=dp.Checkpointer(directory, every=None) "
                f"(saves only when a callback asks), or do not return Action.SAVE."
            )
        if self.saved != at:
            self.settle()  # the save waits for the state anyway; the step's time stays its own
            self.checkpoint.save(self.state)
            self.saved = at
            self.restart_clock()

    def _act(self, at: int) -> bool:
        """Do what the callbacks asked (the state is after step ``at``); True: stop."""
        action, self.asked = self.asked, Action(0)
        if Action.SAVE in action:
            self._save(at)
        return Action.STOP in action


def _preempted(ckpt: Checkpointer, state: TrainState, step: int) -> None:
    """Save ``state`` (after ``step``) and end the process as a preempted one: exit 143."""
    ckpt.save(state)
    ckpt.wait()
    print(
        f"{API}: SIGTERM: saved a checkpoint at step {step} in {ckpt.directory}; exiting "
        f"with code {128 + signal.SIGTERM}. Start the same run again to resume there.",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(128 + signal.SIGTERM)
