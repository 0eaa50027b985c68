"""Callbacks: what :meth:`Trainer.fit <jaxcoll.dp.Trainer.fit>` reports as training goes, and
what a callback can ask of it (:class:`Action`: save a checkpoint, stop).

``fit(..., callbacks=[...])`` takes, in any mix:

* a :class:`Callback` (override ``on_step``, ``on_eval`` and/or ``on_end``);
* a metric writer with ``write_scalars(step, scalars)`` (``clu.metric_writers``' interface,
  which flax's examples use; :class:`JsonlWriter` and :class:`~jaxcoll.dp.TensorBoardWriter`
  are ones);
* a plain function ``fn(step, metrics)``, called for every step and every evaluation
  (evaluation keys prefixed ``eval_``, as in the history); it may return an :class:`Action`;
* a component of the loop (:mod:`jaxcoll.dp.loop.components`): :class:`~jaxcoll.dp.Evaluate`,
  :class:`~jaxcoll.dp.Throughput`, :class:`~jaxcoll.dp.Profile`.

All get host floats, after the step (or evaluation) finished, on the process that runs
``fit`` (in a multi-process job: every process; log from ``jax.process_index() == 0``).
:class:`SaveBest` and :class:`EarlyStopping` are the built-in callbacks that act.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
import os
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeAlias, cast


class Action(enum.Flag):
    """What a callback asks :meth:`Trainer.fit` to do: ``Action.SAVE``, ``Action.STOP`` or
    both (``Action.SAVE | Action.STOP``); a hook that returns None asks nothing.

    * ``SAVE``: save the state through ``fit``'s ``checkpoint=`` (a
      :class:`~jaxcoll.dp.Checkpointer`; ``every=None`` saves only on such requests). Asked
      with no ``checkpoint=``, ``fit`` raises RuntimeError at the request; a callback whose
      ``asks_to_save`` is True (:class:`SaveBest`) is refused at the start instead.
    * ``STOP``: end the loop; the steps already dispatched finish, and the end of ``fit``
      runs as usual (the final evaluation and save, ``on_end``).

    From ``on_eval(step, ...)`` an action applies to exactly the state after ``step``
    updates (an evaluation waits for the steps before it). From ``on_step(step, ...)`` it
    applies to the newest state ``fit`` holds when the step's metrics are read: with
    ``prefetch=True`` (the default) step ``step + 1`` is already in flight then (``fit``
    reads each step's metrics one step late so as not to stall the device), so the saved
    state, or the last one, is the state after ``step + 1``; with ``prefetch=False``, the
    state after ``step``.

    In a multi-process job every process must ask the same thing at the same step: decide
    only from values that are the same on every process, the step number and the losses,
    metrics and evaluation results (global means), never from timings
    (``step_time_s``, ``examples_per_s``, ``tokens_per_s``, ``mfu``), ``memory_bytes`` or
    the clock, which each process measures for itself.
    """

    SAVE = enum.auto()
    STOP = enum.auto()


#: Step metrics each process measures for itself: different on every process, so no
#: callback may decide from them in a multi-process job.
PER_PROCESS = frozenset(
    {"step_time_s", "examples_per_s", "tokens_per_s", "mfu", "memory_bytes", "peak_flops"}
)


class Callback:
    """Hooks :meth:`Trainer.fit` calls; the defaults do nothing.

    **Step numbers.** ``step`` is ``state.step`` after the update: 1 for the first step of a
    run. The metrics of step ``s`` were computed on batch ``s - 1`` (``data[s - 1]``) with
    the params before that update, i.e. after ``s - 1`` updates; an evaluation at step ``s``
    uses the params after ``s`` updates. So ``on_step(1, m)["loss"]`` is the initial
    params' loss on the first batch, and ``on_eval(s, r)`` sees the state a checkpoint of
    step ``s`` holds.

    ``on_step`` and ``on_eval`` may return an :class:`Action` (``dp.Action.SAVE``,
    ``dp.Action.STOP``, or both), or None for nothing; what each applies to, and the rule
    for multi-process jobs (decide only from values that are the same on every process), is
    in :class:`Action`. A callback that may return ``Action.SAVE`` sets ``asks_to_save =
    True``, so ``fit`` refuses to start without ``checkpoint=``.

    Example::

        >>> class Print(dp.Callback):
        ...     def on_eval(self, step, results):
        ...         print(f"step {step}: test accuracy {results['accuracy']:.3f}")
        >>> trainer.fit(state, train, epochs=5,
        ...             callbacks=[dp.Evaluate(test, every=len(train)), Print()])

        >>> class StopWhenGood(dp.Callback):  # stop once the training loss is below 0.1
        ...     def on_step(self, step, metrics):
        ...         return dp.Action.STOP if metrics["loss"] < 0.1 else None
    """

    #: True for a callback that may return ``Action.SAVE``: ``fit`` then needs ``checkpoint=``.
    asks_to_save: bool = False

    def on_step(self, step: int, metrics: dict[str, float]) -> Action | None:
        """After each step: ``step`` is ``state.step`` after it (1 for the first step) and
        ``metrics`` its global means (``loss``, the loss's metrics) and the step metrics
        (``step_time_s``, ``examples_per_s``, ``flops_per_step``, ``mfu``, ``lr``, ...:
        the table in docs/dp.md)."""
        return None

    def on_eval(self, step: int, results: dict[str, float]) -> Action | None:
        """After each evaluation: :meth:`Trainer.evaluate`'s results at ``step`` (the params
        after ``step`` updates). With named evaluation sets (``dp.Evaluate({"val": ...})``)
        the keys are ``<name>_<metric>`` (``val_loss``); with one set, the metrics'."""
        return None

    def on_end(self, step: int, history: list[dict[str, Any]]) -> None:
        """Once, when ``fit`` ends normally: the last step and the whole history ``fit``
        returns (flush files here)."""


class JsonlWriter(Callback):
    """A metric writer: one JSON object per line, ``{"step": s, "loss": ..., ...}``.

    Each step and each evaluation appends one line (evaluation keys prefixed ``eval_``),
    opened and closed per write, so the file is complete whenever the run stops. Also usable
    as a ``clu``-style writer: :meth:`write_scalars`.

    Args:
        path: the file to append to (its directory is created).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(
                json.dumps({"step": int(step), **{k: float(v) for k, v in scalars.items()}}) + "\n"
            )

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.write_scalars(step, metrics)

    def on_eval(self, step: int, results: dict[str, float]) -> None:
        self.write_scalars(step, {f"eval_{k}": v for k, v in results.items()})


class _Watch(Callback):
    """The metric a built-in acting callback follows: ``eval_*`` names at evaluations,
    others at steps; an improvement is a change past ``min_delta`` in ``mode``'s sense."""

    def __init__(self, api: str, metric: str, mode: str, min_delta: float) -> None:
        if not isinstance(metric, str):
            raise TypeError(
                f"{api}: metric must be a str, a key of fit's history (e.g. 'eval_val_loss', "
                f"'eval_loss', 'loss'), got {type(metric).__name__} instead."
            )
        if metric in PER_PROCESS:
            raise ValueError(
                f"{api}: metric={metric!r} is measured by each process for itself, so the "
                f"processes of a job would decide differently; follow a loss, a metric of the "
                f"loss or an evaluation result (e.g. 'eval_loss')."
            )
        if mode not in ("min", "max"):
            raise ValueError(
                f"{api}: mode={mode!r} must be 'min' (lower is better: a loss) or 'max' "
                f"(higher is better: an accuracy)."
            )
        if isinstance(min_delta, bool) or not isinstance(min_delta, numbers.Real):
            raise TypeError(
                f"{api}: min_delta must be a number (the least change that counts as an "
                f"improvement), got {type(min_delta).__name__} instead."
            )
        if not min_delta >= 0:
            raise ValueError(
                f"{api}: min_delta={min_delta!r} must be >= 0 (the least change that counts "
                f"as an improvement)."
            )
        self.api: str = api
        self.metric: str = metric
        self.mode: str = mode
        self.min_delta: float = float(min_delta)
        self.best: float | None = None
        self.best_step: int | None = None

    def _value(self, step: int, values: dict[str, float], prefix: str) -> float:
        key = self.metric[len(prefix) :]
        if key not in values:
            have = ", ".join(sorted(prefix + k for k in values)) or "none"
            raise ValueError(
                f"{self.api}: metric={self.metric!r} is not among the values fit reported at "
                f"step {step} ({have}); pass one of them (named evaluation sets give "
                f"eval_<name>_<metric>, e.g. 'eval_val_loss'; a single set eval_<metric>)."
            )
        return float(values[key])

    def _improved(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _check(self, step: int, value: float) -> Action | None:
        raise NotImplementedError

    def on_step(self, step: int, metrics: dict[str, float]) -> Action | None:
        if self.metric.startswith("eval_"):
            return None
        return self._check(step, self._value(step, metrics, ""))

    def on_eval(self, step: int, results: dict[str, float]) -> Action | None:
        if not self.metric.startswith("eval_"):
            return None
        return self._check(step, self._value(step, results, "eval_"))


class SaveBest(_Watch):
    """Save a checkpoint whenever ``metric`` improves: nanoGPT's "save only when the
    validation loss improves".

    Returns ``Action.SAVE`` at each step whose ``metric`` beats the best so far (the first
    value always does; NaN never does). Pair it with ``checkpoint=dp.Checkpointer(directory,
    every=None)``, which saves only on request: the newest checkpoint is then the best
    state, and a run started again restores it. (With ``every=k`` the periodic and final
    saves are there too, and the newest checkpoint is the last state.) Its best value lives
    in the callback, not the checkpoint: a run started again counts its first value as an
    improvement.

    Args:
        metric: a key of ``fit``'s history: ``eval_<name>_<metric>`` for a named evaluation
            set (``eval_val_loss`` for ``dp.Evaluate({"val": ...})``), ``eval_<metric>`` for a
            single set (both followed at evaluations: exact steps); a training metric
            (``loss``) is followed at every step, and its save applies as in
            :class:`Action`. Not a timing or memory metric: they differ between processes.
        mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).
        min_delta: the least change over the best that counts as an improvement.

    Attributes:
        best: the best value so far (None before the first).
        best_step: its step.
        saved: the steps it asked to save, in order.

    Example::

        >>> ckpt = dp.Checkpointer("/tmp/best", every=None)
        >>> state, history = trainer.fit(
        ...     state, train, steps=5000, checkpoint=ckpt,
        ...     callbacks=[dp.Evaluate({"val": val}, every=250), dp.SaveBest("eval_val_loss")])
    """

    asks_to_save = True

    def __init__(
        self, metric: str = "eval_val_loss", mode: str = "min", min_delta: float = 0.0
    ) -> None:
        super().__init__("dp.SaveBest", metric, mode, min_delta)
        self.saved: list[int] = []

    def _check(self, step: int, value: float) -> Action | None:
        if not self._improved(value):
            return None
        self.best, self.best_step = value, step
        self.saved.append(step)
        return Action.SAVE


class EarlyStopping(_Watch):
    """Stop training when ``metric`` has not improved for ``patience`` checks in a row
    (Keras' and Lightning's ``EarlyStopping``).

    Each value of ``metric`` (each evaluation, for an ``eval_*`` metric) that does not beat
    the best so far by more than ``min_delta`` counts one; an improvement resets the count.
    At ``patience`` it returns ``Action.STOP``: ``fit`` ends after that step, with its final
    evaluation and save as usual (see :class:`Action`).

    Args:
        metric: a key of ``fit``'s history, as for :class:`SaveBest` (default
            ``"eval_loss"``: a single evaluation set's loss).
        patience: how many checks without improvement end the run.
        mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).
        min_delta: the least change over the best that counts as an improvement.

    Attributes:
        best, best_step: the best value so far and its step.
        stopped_step: the step at which it asked to stop (None if it did not).

    Example::

        >>> stop = dp.EarlyStopping("eval_val_loss", patience=3)
        >>> state, history = trainer.fit(
        ...     state, train, steps=10_000,
        ...     callbacks=[dp.Evaluate({"val": val}, every=200), stop])
        >>> stop.stopped_step  # None if it ran all 10_000 steps
    """

    def __init__(
        self,
        metric: str = "eval_loss",
        patience: int = 3,
        mode: str = "min",
        min_delta: float = 0.0,
    ) -> None:
        super().__init__("dp.EarlyStopping", metric, mode, min_delta)
        if isinstance(patience, bool) or not isinstance(patience, numbers.Integral):
            raise TypeError(
                f"dp.EarlyStopping: patience must be an int (checks without improvement "
                f"before stopping), got {type(patience).__name__} instead."
            )
        if patience < 1:
            raise ValueError(
                f"dp.EarlyStopping: patience={patience!r} must be >= 1 (checks without "
                f"improvement before stopping)."
            )
        self.patience: int = int(patience)
        self.wait: int = 0
        self.stopped_step: int | None = None

    def _check(self, step: int, value: float) -> Action | None:
        if self._improved(value):
            self.best, self.best_step, self.wait = value, step, 0
            return None
        self.wait += 1
        if self.wait >= self.patience and self.stopped_step is None:
            self.stopped_step = step
            return Action.STOP
        return None


class MetricWriter(Protocol):
    """A metric writer (``clu.metric_writers``' interface): what :meth:`Trainer.fit` calls."""

    def write_scalars(self, step: int, scalars: dict[str, float]) -> object: ...


#: One entry of ``fit(callbacks=...)``: a Callback, a metric writer or ``fn(step, metrics)``.
CallbackLike: TypeAlias = Callback | MetricWriter | Callable[[int, dict[str, float]], Any]


class _Writer(Callback):
    def __init__(self, writer: MetricWriter) -> None:
        self.writer = writer

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.writer.write_scalars(step, metrics)

    def on_eval(self, step: int, results: dict[str, float]) -> None:
        self.writer.write_scalars(step, {f"eval_{k}": v for k, v in results.items()})

    def on_end(self, step: int, history: list[dict[str, Any]]) -> None:
        flush = getattr(self.writer, "flush", None)  # clu's writers have one
        if callable(flush):
            flush()


class _Function(Callback):
    """A function ``fn(step, metrics)``; what it returns counts only if it is an Action (a
    lambda's incidental value, e.g. ``list.append``'s, is not a request)."""

    def __init__(self, fn: Callable[[int, dict[str, float]], Any]) -> None:
        self.fn = fn

    def on_step(self, step: int, metrics: dict[str, float]) -> Action | None:
        out = self.fn(step, metrics)
        return out if isinstance(out, Action) else None

    def on_eval(self, step: int, results: dict[str, float]) -> Action | None:
        out = self.fn(step, {f"eval_{k}": v for k, v in results.items()})
        return out if isinstance(out, Action) else None


def requested(api: str, cb: Callback, hook: str, out: object) -> Action:
    """What a hook's return value asks: an :class:`Action` (``Action(0)`` for None)."""
    if out is None:
        return Action(0)
    if isinstance(out, Action):
        return out
    name = type(cb.fn).__name__ if isinstance(cb, _Function) else type(cb).__name__
    raise TypeError(
        f"{api}: the callback {name}.{hook} returned {out!r} of type {type(out).__name__}; "
        f"a callback returns None (nothing to do) or a dp.Action: dp.Action.SAVE, "
        f"dp.Action.STOP, or both (dp.Action.SAVE | dp.Action.STOP)."
    )


def as_callbacks(
    api: str, callbacks: CallbackLike | Iterable[CallbackLike] | None
) -> list[Callback]:
    """Each entry of ``callbacks`` as a :class:`Callback` (see the module docstring)."""
    if callbacks is None:
        return []
    # Each entry is checked below, whatever its static type says.
    entries: Iterable[object]
    if (
        isinstance(callbacks, Callback)
        or callable(callbacks)
        or hasattr(callbacks, "write_scalars")
    ):
        entries = [callbacks]
    else:
        entries = cast("Iterable[object]", callbacks)
    out: list[Callback] = []
    for cb in entries:
        if isinstance(cb, Callback):
            out.append(cb)
        elif hasattr(cb, "write_scalars"):
            out.append(_Writer(cb))
        elif callable(cb):
            out.append(_Function(cb))
        else:
            raise TypeError(
                f"{api}: callbacks must hold dp.Callback objects, metric writers "
                f"(write_scalars(step, scalars)) or functions fn(step, metrics), "
                f"got {type(cb).__name__} instead."
            )
    return out
