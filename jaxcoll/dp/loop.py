"""The host loop: :func:`fit` (steps, prefetch, evaluation, checkpoints, callbacks) and
:func:`evaluate` (exact means over any number of examples).

Host-side Python around the jitted programs of :mod:`jaxcoll.dp.step`. :func:`fit` *is*
``Trainer.fit`` (one signature and one list of options, here); ``Trainer.evaluate`` calls
:func:`evaluate` with its own evaluation program.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from .._core.checks import check_static_int
from .._core.typing import PyTree
from .._watch import handle_preemption, preemption_point
from .callbacks import CallbackLike, as_callbacks
from .checkpoint import Checkpointer
from .checks import check_state
from .data import Batches, leading_size
from .state import TrainState


class Steps(Protocol):
    """What :func:`fit` uses of a :class:`~jaxcoll.dp.Trainer`."""

    def step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]: ...

    def shard_batch(self, batch: PyTree) -> PyTree: ...

    def evaluate(self, state: TrainState, data: Batches | Iterable[PyTree]) -> dict[str, float]: ...


def total_steps(data: Any, steps: int | None, epochs: int | None) -> int:
    if (steps is None) == (epochs is None):
        raise ValueError(
            "Trainer.fit: pass exactly one of steps= (the total step count to reach) or epochs=."
        )
    if steps is not None:
        return check_static_int("Trainer.fit", "steps", steps)
    epochs = check_static_int("Trainer.fit", "epochs", epochs)
    try:
        return epochs * len(data)
    except TypeError:
        raise TypeError(
            "Trainer.fit: epochs= needs data with a length (e.g. dp.Batches); "
            "pass steps= for an iterator."
        ) from None


def check_data(api: str, argname: str, data: Any) -> None:
    """``data`` must be batches, not one batch: a dict would iterate over its keys."""
    if isinstance(data, Mapping):
        raise TypeError(
            f"{api}: {argname} is a dict (one batch?); pass an iterable of global "
            f"batches, e.g. [{argname}], or a dp.Batches."
        )


def batch_source(data: Any, start: int) -> Callable[[int], PyTree]:
    if hasattr(data, "__getitem__") and hasattr(data, "epoch"):
        return data.__getitem__
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
    metrics: dict[str, jax.Array]  # device arrays


def fit(
    trainer: Steps,
    state: TrainState,
    data: Batches | Iterable[PyTree],
    *,
    steps: int | None = None,
    epochs: int | None = None,
    eval_data: Batches | Iterable[PyTree] | None = None,
    eval_every: int | None = None,
    callbacks: CallbackLike | Iterable[CallbackLike] | None = None,
    checkpoint: Checkpointer | None = None,
    progress: bool | None = None,
    log_every: int = 10,
    prefetch: bool = True,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """``Trainer.fit(state, data, ...)``: train until ``state.step`` reaches ``steps`` (or
    ``epochs`` epochs of ``data``).

    ``data`` is a :class:`~jaxcoll.dp.Batches` (batch s is ``data[s]``, so a resumed run
    sees exactly the batches it would have) or any iterable of global batches (a resumed
    run skips the first ``state.step`` of them). With ``checkpoint``, the newest checkpoint
    in its directory that reads back is restored first (a damaged one is skipped with a
    warning), and the state is saved every ``checkpoint.every`` steps and at the end
    (orbax-checkpoint): a run stopped at any point and started again with the same
    arguments ends bit-identical to one that was never stopped. With a checkpoint, SIGTERM
    (a preemption) stops every process after the same step, which is saved, and exits with
    code 143.

    Args:
        trainer: the :class:`~jaxcoll.dp.Trainer` (``self``: this function is its ``fit``).
        state: the state :meth:`Trainer.init` returned (or a later step's).
        data: the global batches, as above.
        steps: the total step count to reach (``state.step`` included: a resumed run takes
            the rest).
        epochs: the same in epochs of ``data`` (``epochs * len(data)`` steps); pass exactly
            one of ``steps`` and ``epochs``.
        eval_data: evaluated (:meth:`Trainer.evaluate`) every ``eval_every`` steps and at
            the end.
        eval_every: steps between evaluations (``len(data)``: once per epoch); None: at the
            end only.
        callbacks: :class:`~jaxcoll.dp.Callback` objects, metric writers with
            ``write_scalars(step, scalars)`` (``dp.JsonlWriter``, clu's) or functions
            ``fn(step, metrics)``: each gets every step's metrics and every evaluation's
            results as they happen (see :mod:`jaxcoll.dp.callbacks`).
        checkpoint: a :class:`~jaxcoll.dp.Checkpointer` (``dp.Checkpointer(directory,
            every=100)``); None: no checkpoints.
        progress: a tqdm bar; None (default): only when stderr is a terminal.
        log_every: steps between updates of the bar's loss.
        prefetch: build and place batch s+1 while step s runs (at most two steps in
            flight); False: one step at a time, each waited for before the next batch.

    Returns:
        The final state and a history: one dict per step taken in this call with the step,
        the metrics and ``examples_per_s``; at each evaluation, that step's dict also has
        ``eval_<metric>`` for each metric of :meth:`Trainer.evaluate`.

    With ``prefetch``, step s is dispatched, then batch s+1 is built and placed (its host
    work and transfer overlap step s), then the loop waits for step s-1: at most two steps
    are in flight (XLA:CPU's in-process rendezvous can stall with many queued collective
    programs on few cores).
    """
    from tqdm.auto import tqdm

    api = "Trainer.fit"
    check_state(api, state)
    check_data(api, "data", data)
    if eval_data is not None:
        check_data(api, "eval_data", eval_data)
    total = total_steps(data, steps, epochs)
    if eval_every is not None:
        eval_every = check_static_int(api, "eval_every", eval_every)
        if eval_every < 1:
            raise ValueError(
                f"{api}: eval_every={eval_every} must be a positive number of "
                f"steps (len(train_batches) for once per epoch), or None."
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
    if progress is None:  # a bar only where someone watches it; not in logs or CI
        progress = sys.stderr.isatty()
    history: list[dict[str, Any]] = []
    bar = None
    try:
        if checkpoint is not None:
            state = checkpoint.restore_latest(state)
        start = int(jax.device_get(state.step))
        source = batch_source(data, start)
        bar = tqdm(
            total=total, initial=start, disable=not progress, unit="step", dynamic_ncols=True
        )
        clock = [time.perf_counter()]

        def complete(p: Pending) -> None:
            # The step's outputs are available here (waiting for them if needed).
            metrics = {k: float(v) for k, v in jax.device_get(p.metrics).items()}
            now = time.perf_counter()
            rate = p.examples / max(now - clock[0], 1e-9)
            clock[0] = now
            history.append({"step": p.step, **metrics, "examples_per_s": rate})
            for cb in cbs:
                cb.on_step(p.step, {**metrics, "examples_per_s": rate})
            bar.update(1)
            if progress and (p.step % log_every == 0 or p.step == total):
                bar.set_postfix(loss=f"{metrics['loss']:.4f}")

        evaluated = [-1]

        def run_eval(at: int, batches: Batches | Iterable[PyTree]) -> None:
            results = trainer.evaluate(state, batches)
            evaluated[0] = at
            if history and history[-1]["step"] == at:
                history[-1].update({f"eval_{k}": v for k, v in results.items()})
            else:
                history.append({"step": at, **{f"eval_{k}": v for k, v in results.items()}})
            for cb in cbs:
                cb.on_eval(at, results)

        def fetch(s: int) -> tuple[PyTree, int]:
            batch = source(s)
            return trainer.shard_batch(batch), leading_size("Trainer.step", batch)

        upcoming = fetch(start) if start < total else None
        pending: Pending | None = None
        # With checkpoints, SIGTERM (a preemption) stops every process after the same step,
        # which is saved; without, it ends the process at once (jaxcoll's default).
        preemptible = handle_preemption() if checkpoint is not None else contextlib.nullcontext()
        with preemptible:
            for s in range(start, total):
                batch, size = upcoming if upcoming is not None else fetch(s)
                state, metrics = trainer.step(state, batch)  # each step is dispatched here
                if checkpoint is not None and preemption_point(s + 1):
                    _preempted(api, checkpoint, state, s + 1)
                upcoming = fetch(s + 1) if prefetch and s + 1 < total else None
                if pending is not None:
                    complete(pending)  # waits for the step before: at most 2 in flight
                pending = Pending(s + 1, size, metrics)
                if not prefetch:  # one step at a time: wait for it before building the next batch
                    complete(pending)
                    pending = None
                if checkpoint is not None and (s + 1) % checkpoint.every == 0:
                    checkpoint.save(state)
                if eval_data is not None and eval_every and (s + 1) % eval_every == 0:
                    if pending is not None:
                        complete(pending)
                        pending = None
                    run_eval(s + 1, eval_data)
        if pending is not None:
            complete(pending)
        if checkpoint is not None:
            checkpoint.save(state)
        if eval_data is not None and evaluated[0] != max(start, total):
            run_eval(max(start, total), eval_data)
    finally:  # a crash keeps only the periodic checkpoints, as a killed process would
        if bar is not None:
            bar.close()
        if checkpoint is not None:
            checkpoint.close()
    return state, history


def _preempted(api: str, ckpt: Checkpointer, state: TrainState, step: int) -> None:
    """Save ``state`` (after ``step``) and end the process as a preempted one: exit 143."""
    ckpt.save(state)
    ckpt.manager.wait_until_finished()
    print(
        f"{api}: SIGTERM: saved a checkpoint at step {step} in {ckpt.directory}; exiting "
        f"with code {128 + signal.SIGTERM}. Start the same run again to resume there.",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(128 + signal.SIGTERM)
