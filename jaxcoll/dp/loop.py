"""The host loop: :func:`fit` (steps, checkpoints, progress, history) and :func:`evaluate`.

Host-side Python around the jitted programs of :mod:`jaxcoll.dp.step`; ``Trainer.fit`` and
``Trainer.evaluate`` call these with their own step and evaluation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core.checks import check_static_int
from .._core.typing import PyTree
from .checkpoint import Checkpointer
from .state import TrainState

StepFn = Callable[[TrainState, PyTree], tuple[TrainState, dict[str, jax.Array]]]


def total_steps(data: Any, steps: int | None, epochs: int | None) -> int:
    if (steps is None) == (epochs is None):
        raise ValueError("Trainer.fit: pass exactly one of steps= (the total step count to "
                         "reach) or epochs=.")
    if steps is not None:
        return check_static_int("Trainer.fit", "steps", steps)
    epochs = check_static_int("Trainer.fit", "epochs", epochs)
    try:
        return epochs * len(data)
    except TypeError:
        raise TypeError("Trainer.fit: epochs= needs data with a length (e.g. dp.Batches); "
                        "pass steps= for an iterator.") from None


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
            raise ValueError("Trainer.fit: data ran out of batches before steps= was "
                             "reached.") from None

    return source


def finish_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn device metrics into floats (one transfer) and add examples/s per step."""
    host = jax.device_get(history)
    end = time.perf_counter()
    out = []
    for i, h in enumerate(host):
        t1 = host[i + 1]["t0"] if i + 1 < len(host) else end
        rec = {k: (float(v) if k not in ("step", "examples") else int(v))
               for k, v in h.items() if k != "t0"}
        rec["examples_per_s"] = h["examples"] / max(t1 - h["t0"], 1e-9)
        out.append(rec)
    return out


def evaluate(metrics_of: Callable[[PyTree], dict[str, jax.Array]], data: Any) -> dict[str, float]:
    """Average ``metrics_of(batch)`` over every example of ``data``, batches weighted by size.

    ``data``: an iterable of global batches, or a :class:`~jaxcoll.dp.Batches` (its first
    epoch).
    """
    batches = data.epoch(0) if hasattr(data, "epoch") else data
    totals: dict[str, float] = {}
    count = 0
    for batch in batches:
        size = np.shape(jax.tree_util.tree_leaves(batch)[0])[0]
        out = jax.device_get(metrics_of(batch))
        for name, value in out.items():
            totals[name] = totals.get(name, 0.0) + float(value) * size
        count += size
    if not count:
        raise ValueError("Trainer.evaluate: data yielded no batch.")
    return {name: value / count for name, value in totals.items()}


def fit(
    step: StepFn,
    state: TrainState,
    data: Any,
    *,
    steps: int | None,
    epochs: int | None,
    evaluate_fn: Callable[[TrainState, Any], dict[str, float]] | None = None,
    eval_data: Any = None,
    checkpoint_dir: str | None = None,
    every: int = 100,
    progress: bool = True,
    log_every: int = 10,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Run ``step`` until ``state.step`` reaches the total; see :meth:`Trainer.fit`."""
    from tqdm.auto import tqdm

    total = total_steps(data, steps, epochs)
    ckpt = None
    if checkpoint_dir is not None:
        ckpt = Checkpointer(checkpoint_dir, every=every)
        state = ckpt.restore_latest(state)
    start = int(jax.device_get(state.step))
    source = batch_source(data, start)
    history: list[dict[str, Any]] = []
    bar = tqdm(total=total, initial=start, disable=not progress, unit="step",
               dynamic_ncols=True)
    try:
        for s in range(start, total):
            batch = source(s)
            size = np.shape(jax.tree_util.tree_leaves(batch)[0])[0]
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            # Wait for the step: honest examples/s, and one program in flight at a time
            # (many queued collective programs on few CPU cores can stall XLA's rendezvous).
            metrics = jax.block_until_ready(metrics)
            history.append({"step": s + 1, "examples": size, "t0": t0, **metrics})
            if ckpt is not None and (s + 1) % every == 0:
                ckpt.save(state)
            bar.update(1)
            if progress and ((s + 1) % log_every == 0 or s + 1 == total):
                bar.set_postfix(loss=f"{float(metrics['loss']):.4f}")
        if ckpt is not None:
            ckpt.save(state)
    finally:  # a crash keeps only the periodic checkpoints, as a killed process would
        bar.close()
        if ckpt is not None:
            ckpt.close()
    history = finish_history(history)
    if eval_data is not None and evaluate_fn is not None:
        results = evaluate_fn(state, eval_data)
        if history:
            history[-1].update({f"eval_{k}": v for k, v in results.items()})
        else:
            history.append({f"eval_{k}": v for k, v in results.items()})
    return state, history
