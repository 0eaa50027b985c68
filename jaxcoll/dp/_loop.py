"""Helpers of ``Trainer.fit``: how many steps, where batches come from, the history."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from .._core.checks import check_static_int
from .._core.typing import PyTree


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
