"""The built-in callbacks that act on one metric of ``fit``'s history: :class:`SaveBest` (save
whenever it improves) and :class:`EarlyStopping` (stop once it stops improving)."""

from __future__ import annotations

import math
import numbers

from ..._core.checks import check_count
from .base import PER_PROCESS, Action, Callback


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
            :class:`~jaxcoll.dp.Action`. Not a timing or memory metric: they differ between
            processes.
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
    evaluation and save as usual (see :class:`~jaxcoll.dp.Action`).

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
        what = "checks without improvement before stopping"
        self.patience: int = check_count("dp.EarlyStopping", "patience", patience, 1, what)
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
