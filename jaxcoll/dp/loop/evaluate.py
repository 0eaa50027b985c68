"""Evaluation, through one door: :func:`evaluate` computes the exact means over any number of
examples, :meth:`Trainer.evaluate <jaxcoll.dp.Trainer.evaluate>` runs it on its evaluation
program, and :class:`Evaluate`, the component that evaluates during ``fit``, calls
``Trainer.evaluate`` for each of its sets."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import numpy as np

from ..._core.typing import PyTree
from ..data.batches import Batches, leading_size
from .args import EvalData, check_data, eval_sets, positive
from .components import Component, Loop


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


class Evaluate(Component):
    """Evaluate during ``fit``: every ``every`` steps and at the end
    (:meth:`Trainer.evaluate`, exact means over every example), passed in ``callbacks=``.

    The results go into that step's history entry as ``eval_<key>`` (``eval_loss``,
    ``eval_accuracy``, ...) and to every callback's ``on_eval(step, results)``, so
    :class:`~jaxcoll.dp.SaveBest` and :class:`~jaxcoll.dp.EarlyStopping` can follow them. An
    evaluation at step s waits for the steps before it and uses the params after s updates.

    Args:
        data: batches (an iterable of global batches, or a :class:`~jaxcoll.dp.Batches`:
            results ``loss``, ``accuracy``, ...), or named sets ``{"val": val_batches,
            "train": train_sample}``, each evaluated every time (results ``val_loss``,
            ``train_loss``, ...; history ``eval_val_loss``, ...).
        every: steps between evaluations (``len(train)``: once per epoch); None: at the end
            only.
        on_start: also evaluate the state ``fit`` starts from (the initial state, or the
            restored one), before the first step: nanoGPT's evaluation at iteration 0, a
            baseline for the curves (Hugging Face's ``eval_on_start``). It is reported with
            ``step`` = ``state.step`` at the start (0 for a new run): a history entry of its
            own and ``on_eval(start, results)``.

    Example::

        >>> trainer.fit(state, train, epochs=5,
        ...             callbacks=[dp.Evaluate({"val": val}, every=len(train))])
    """

    def __init__(self, data: EvalData, every: int | None = None, on_start: bool = False) -> None:
        api = "dp.Evaluate"
        self.sets = eval_sets(api, data)
        self.every = positive(
            api, "every", every, "number of steps (len(train_batches) for once per epoch)"
        )
        if not isinstance(on_start, bool):
            raise TypeError(
                f"{api}: on_start must be True or False, got {on_start!r} of type "
                f"{type(on_start).__name__} instead."
            )
        self.at_start = on_start
        self.last = -1  # the step of the last evaluation in this fit

    def on_fit_start(self, loop: Loop) -> None:
        self.last = -1
        if self.at_start:  # the state fit starts from, before any step (nanoGPT's iter 0)
            self.run(loop, loop.start)

    def after_step(self, loop: Loop, step: int) -> None:
        if self.every and step % self.every == 0:
            loop.settle()
            self.run(loop, step)

    def after_last_step(self, loop: Loop, step: int) -> None:
        if self.last != step:
            self.run(loop, step)

    def run(self, loop: Loop, step: int) -> None:
        """Evaluate every set on ``loop.state`` (after ``step`` updates) and report it."""
        results: dict[str, float] = {}
        for prefix, batches in self.sets:
            for k, v in loop.trainer.evaluate(loop.state, batches).items():
                results[prefix + k] = v
        self.last = step
        loop.report_eval(step, results)
