"""Callbacks: what :meth:`Trainer.fit <jaxcoll.dp.Trainer.fit>` reports as training goes.

``fit(..., callbacks=[...])`` takes, in any mix:

* a :class:`Callback` (override ``on_step`` and/or ``on_eval``);
* a metric writer with ``write_scalars(step, scalars)`` (``clu.metric_writers``' interface,
  which flax's examples use; :class:`JsonlWriter` is one);
* a plain function ``fn(step, metrics)``, called for every step and every evaluation
  (evaluation keys prefixed ``eval_``, as in the history).

All get host floats, after the step (or evaluation) finished, on the process that runs
``fit`` (in a multi-process job: every process; log from ``jax.process_index() == 0``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeAlias, cast


class Callback:
    """Hooks :meth:`Trainer.fit` calls; the defaults do nothing.

    Example::

        >>> class Print(dp.Callback):
        ...     def on_eval(self, step, results):
        ...         print(f"step {step}: test accuracy {results['accuracy']:.3f}")
        >>> trainer.fit(state, train, epochs=5, eval_data=test, eval_every=len(train),
        ...             callbacks=[Print()])
    """

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        """After each step: ``step`` is ``state.step`` after it (1 for the first step) and
        ``metrics`` its global means (``loss``, the loss's metrics, ``examples_per_s``)."""

    def on_eval(self, step: int, results: dict[str, float]) -> None:
        """After each evaluation: :meth:`Trainer.evaluate`'s results at ``step``."""


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


class _Function(Callback):
    def __init__(self, fn: Callable[[int, dict[str, float]], Any]) -> None:
        self.fn = fn

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.fn(step, metrics)

    def on_eval(self, step: int, results: dict[str, float]) -> None:
        self.fn(step, {f"eval_{k}": v for k, v in results.items()})


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
