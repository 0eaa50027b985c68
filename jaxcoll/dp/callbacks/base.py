"""Callbacks: what :meth:`Trainer.fit <jaxcoll.dp.Trainer.fit>` reports as training goes, and
what a callback can ask of it (:class:`Action`: save a checkpoint, stop).

``fit(..., callbacks=[...])`` takes, in any mix:

* a :class:`Callback` (override ``on_step``, ``on_eval`` and/or ``on_end``);
* a metric writer with ``write_scalars(step, scalars)`` (``clu.metric_writers``' interface,
  which flax's examples use; :class:`~jaxcoll.dp.JsonlWriter` and
  :class:`~jaxcoll.dp.TensorBoardWriter` are ones, on :class:`ScalarWriter`);
* a plain function ``fn(step, metrics)``, called for every step and every evaluation
  (evaluation keys prefixed ``eval_``, as in the history); it may return an :class:`Action`;
* a component of the loop (:mod:`jaxcoll.dp.loop.components`): :class:`~jaxcoll.dp.Evaluate`,
  :class:`~jaxcoll.dp.Throughput`, :class:`~jaxcoll.dp.Profile`.

All get host floats, after the step (or evaluation) finished, on the process that runs
``fit`` (in a multi-process job: every process; log from ``jax.process_index() == 0``).
:class:`~jaxcoll.dp.SaveBest` and :class:`~jaxcoll.dp.EarlyStopping`
(:mod:`jaxcoll.dp.callbacks.rules`) are the built-in callbacks that act.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeAlias, cast


class Action(enum.Flag):
    """What a callback asks :meth:`Trainer.fit` to do: ``Action.SAVE``, ``Action.STOP`` or
    both (``Action.SAVE | Action.STOP``); a hook that returns None asks nothing.

    * ``SAVE``: save the state through ``fit``'s ``checkpoint=`` (a
      :class:`~jaxcoll.dp.Checkpointer`; ``every=None`` saves only on such requests). Asked
      with no ``checkpoint=``, ``fit`` raises RuntimeError at the request; a callback whose
      ``asks_to_save`` is True (:class:`~jaxcoll.dp.SaveBest`) is refused at the start instead.
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


def eval_keys(results: dict[str, float]) -> dict[str, float]:
    """An evaluation's results as the history keys them: each key prefixed ``eval_``."""
    return {f"eval_{k}": v for k, v in results.items()}


class MetricWriter(Protocol):
    """A metric writer (``clu.metric_writers``' interface): what :meth:`Trainer.fit` calls."""

    def write_scalars(self, step: int, scalars: dict[str, float]) -> object: ...


#: One entry of ``fit(callbacks=...)``: a Callback, a metric writer or ``fn(step, metrics)``.
CallbackLike: TypeAlias = Callback | MetricWriter | Callable[[int, dict[str, float]], Any]


class ScalarWriter(Callback):
    """A callback that writes through its ``write_scalars(step, scalars)`` (a metric
    writer's interface): every step's metrics, and every evaluation's results with their
    keys prefixed ``eval_`` (as in the history)."""

    def write_scalars(self, step: int, scalars: dict[str, float]) -> object:
        raise NotImplementedError

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.write_scalars(step, metrics)

    def on_eval(self, step: int, results: dict[str, float]) -> None:
        self.write_scalars(step, eval_keys(results))


class _Writer(ScalarWriter):
    """Another library's metric writer (clu's): written to as a :class:`ScalarWriter`,
    flushed at the end when it has a ``flush``."""

    def __init__(self, writer: MetricWriter) -> None:
        self.writer = writer

    def write_scalars(self, step: int, scalars: dict[str, float]) -> object:
        return self.writer.write_scalars(step, scalars)

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
        out = self.fn(step, eval_keys(results))
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
