"""The host loop's entry point, :func:`fit` (``Trainer.fit``), and :func:`evaluate`
(``Trainer.evaluate``'s exact means, in :mod:`jaxcoll.dp.loop.evaluate`).

:func:`fit` checks its arguments and runs a :class:`~jaxcoll.dp.loop.runner.Runner` (the steps,
prefetch, checkpoints, callbacks and their actions); evaluation, throughput and MFU,
profiling and the progress bar are components passed in ``callbacks=``
(:mod:`jaxcoll.dp.loop.components`). The step metrics (time, FLOPs, learning rate, memory) are
computed in :mod:`jaxcoll.dp.reports.metrics`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from ..._core.typing import PyTree
from ..callbacks.base import Callback, CallbackLike, as_callbacks
from ..checkpoint.checkpointer import Checkpointer
from ..checks import check_flag, check_state
from ..data.batches import Batches
from ..state import TrainState
from .args import check_checkpoint, check_data, total_steps
from .components import Progress, Steps
from .evaluate import evaluate as evaluate  # Trainer.evaluate's
from .runner import Runner


def fit(
    trainer: Steps,
    state: TrainState,
    data: Batches | Iterable[PyTree],
    *,
    steps: int | None = None,
    epochs: int | None = None,
    callbacks: CallbackLike | Iterable[CallbackLike] | None = None,
    checkpoint: Checkpointer | None = None,
    progress: bool | Progress | None = None,
    prefetch: bool = True,
    **gone: Any,
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

    Step numbers, everywhere (callbacks, history, :class:`~jaxcoll.dp.Profile`): ``step`` is
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
        callbacks: :class:`~jaxcoll.dp.Callback` objects, metric writers with
            ``write_scalars(step, scalars)`` (``dp.JsonlWriter``, ``dp.TensorBoardWriter``,
            clu's) or functions ``fn(step, metrics)``: each gets every step's metrics and
            every evaluation's results as they happen (see :mod:`jaxcoll.dp.callbacks.base`), and
            may return a :class:`~jaxcoll.dp.Action` (save a checkpoint, stop). The loop's
            components are callbacks too: :class:`~jaxcoll.dp.Evaluate` (evaluation every k
            steps and at the end), :class:`~jaxcoll.dp.Throughput` (tokens/s, MFU) and
            :class:`~jaxcoll.dp.Profile` (a ``jax.profiler`` trace).
        checkpoint: a :class:`~jaxcoll.dp.Checkpointer` (``dp.Checkpointer(directory,
            every=100)``); None: no checkpoints (a callback that asks to save is then an
            error: at the start for one with ``asks_to_save``, such as ``dp.SaveBest``,
            else at its request).
        progress: a tqdm bar (:class:`~jaxcoll.dp.Progress`; ``dp.Progress(every=50)``
            updates its loss every 50 steps, True every 10); None (default): only when
            stderr is a terminal.
        prefetch: build and place batch s+1 while step s runs (at most two steps in
            flight); False: one step at a time, each waited for before the next batch.
        **gone: the keywords ``fit`` took before its components (``eval_data``,
            ``eval_every``, ``eval_on_start``, ``tokens_per_example``, ``peak_flops``,
            ``profile_steps``, ``profile_dir``, ``log_every``) are gone: each raises a
            TypeError naming the component to pass instead.

    Returns:
        The final state and a history: one dict per step taken in this call with the step,
        the loss and the loss's metrics, and the step metrics (``step_time_s``,
        ``examples_per_s``, ``flops_per_step``, ``lr``, ``memory_bytes``, and with
        ``dp.Throughput`` ``tokens_per_s`` and ``mfu``: see :mod:`jaxcoll.dp.reports.metrics`); at
        each evaluation, that step's dict also has ``eval_<key>`` for each key of the
        evaluation's results (``eval_loss``, or ``eval_val_loss`` for a named set).

    With ``prefetch``, step s is dispatched, then batch s+1 is built and placed (its host
    work and transfer overlap step s), then the loop waits for step s-1: at most two steps
    are in flight (XLA:CPU's in-process rendezvous can stall with many queued collective
    programs on few cores). The step metrics add no wait: they are read with the loss.
    """
    api = "Trainer.fit"
    _check_keywords(api, gone)
    check_state(api, state)
    check_data(api, "data", data)
    total = total_steps(data, steps, epochs)
    prefetch = check_flag(api, "prefetch", prefetch)
    cbs = as_callbacks(api, callbacks)
    check_checkpoint(api, checkpoint, cbs)
    cbs += _progress(api, progress, cbs)  # last: the bar moves once the callbacks are done
    return Runner(trainer, state, data, total, cbs, checkpoint, prefetch).run()


def _progress(api: str, progress: Any, callbacks: list[Callback]) -> list[Callback]:
    """``fit``'s ``progress=`` as the bar to add (none, or one :class:`Progress`)."""
    if isinstance(progress, Progress):
        return [progress]
    if progress is None:  # a bar only where someone watches it; not in logs or CI
        shown = any(isinstance(cb, Progress) for cb in callbacks)
        progress = sys.stderr.isatty() and not shown
    if not isinstance(progress, bool):
        raise TypeError(
            f"{api}: progress must be True, False, None (a bar when stderr is a terminal) or "
            f"a dp.Progress(every=...), got {progress!r} of type {type(progress).__name__}."
        )
    return [Progress()] if progress else []


# The keywords fit had before its components, and the component that replaces each.
_GONE = {
    "eval_data": "callbacks=[dp.Evaluate(eval_data, every=eval_every, on_start=eval_on_start)]",
    "eval_every": "callbacks=[dp.Evaluate(eval_data, every=eval_every, on_start=eval_on_start)]",
    "eval_on_start": "callbacks=[dp.Evaluate(eval_data, every=eval_every, on_start=eval_on_start)]",
    "tokens_per_example": "callbacks=[dp.Throughput(tokens_per_example=..., peak_flops=...)]",
    "peak_flops": "callbacks=[dp.Throughput(tokens_per_example=..., peak_flops=...)]",
    "profile_steps": "callbacks=[dp.Profile(profile_dir, steps=profile_steps)]",
    "profile_dir": "callbacks=[dp.Profile(profile_dir, steps=profile_steps)]",
    "log_every": "progress=dp.Progress(every=log_every)",
}


def _check_keywords(api: str, extra: dict[str, Any]) -> None:
    """A TypeError for any keyword ``fit`` does not take, naming the component that replaces
    each of its old keywords (:data:`_GONE`)."""
    gone = [k for k in extra if k in _GONE]
    if gone:
        instead = "; ".join(dict.fromkeys(_GONE[k] for k in gone))
        raise TypeError(
            f"{api}: {', '.join(k + '=' for k in gone)} {'is' if len(gone) == 1 else 'are'} "
            f"gone; pass {instead} instead."
        )
    if extra:
        raise TypeError(
            f"{api}() got an unexpected keyword argument {next(iter(extra))!r}; it takes "
            f"steps=, epochs=, callbacks=, checkpoint=, progress= and prefetch= (evaluation, "
            f"throughput and profiling are callbacks: dp.Evaluate, dp.Throughput, dp.Profile)."
        )
