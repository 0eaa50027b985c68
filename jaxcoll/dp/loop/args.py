"""``fit``'s arguments, checked and normalised before any step: the step count, the data and
evaluation sets (:class:`~jaxcoll.dp.Evaluate`'s), the checkpointer, positive counts."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..._core.checks import check_static_int
from ..._core.typing import PyTree
from ..callbacks.base import Callback
from ..checkpoint.checkpointer import Checkpointer
from ..data.batches import Batches


def total_steps(data: Any, steps: int | None, epochs: int | None) -> int:
    if (steps is None) == (epochs is None):
        raise ValueError(
            "Trainer.fit: pass exactly one of steps= (the total step count to reach) or epochs=."
        )
    name, value = ("steps", steps) if steps is not None else ("epochs", epochs)
    value = check_static_int("Trainer.fit", name, value)
    if value < 0:
        raise ValueError(
            f"Trainer.fit: {name}={value} is negative; {name} counts from the start of "
            f"training (steps= is the total step count to reach, not the steps still to take)."
        )
    if steps is not None:
        return value
    epochs = value
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


EvalData = Batches | Iterable[PyTree] | Mapping[str, Batches | Iterable[PyTree]]


def eval_sets(api: str, eval_data: Any) -> list[tuple[str, Any]]:
    """Evaluation data as ``[(prefix, batches), ...]``: one set with prefix ``""``, or named
    sets (a dict ``{"val": batches, ...}``) with prefixes ``"val_"``, ...; ``api``'s argument
    is called ``data``."""
    if eval_data is None:
        raise TypeError(
            f"{api}: data is None; pass the evaluation batches (an iterable of global "
            f"batches or a dp.Batches), or named sets {{'val': val_batches, ...}}."
        )
    if not isinstance(eval_data, Mapping):
        check_data(api, "data", eval_data)
        return [("", eval_data)]
    if any(hasattr(v, "shape") and hasattr(v, "dtype") for v in eval_data.values()):
        raise TypeError(
            f"{api}: data is a dict (one batch?); pass an iterable of global batches, "
            f"e.g. [data], or a dp.Batches; named evaluation sets are a dict of such "
            f"iterables, e.g. {{'val': val_batches, 'train': train_batches}}."
        )
    if not eval_data:
        raise ValueError(
            f"{api}: data is an empty dict; pass named evaluation sets, e.g. "
            f"{{'val': val_batches}} (no evaluation: leave the evaluation out)."
        )
    sets = []
    for name, batches in eval_data.items():
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"{api}: data's keys name the evaluation sets (results are keyed "
                f"<name>_<metric>, e.g. 'val_loss') and must be non-empty str, got {name!r} "
                f"of type {type(name).__name__}; pass e.g. {{'val': val_batches}}."
            )
        if isinstance(batches, Mapping):
            raise TypeError(
                f"{api}: data[{name!r}] is a dict (one batch?); each named set is an "
                f"iterable of global batches, e.g. {{{name!r}: [batch]}}, or a dp.Batches."
            )
        if not isinstance(batches, (Batches, Iterable)):
            raise TypeError(
                f"{api}: data[{name!r}] is a {type(batches).__name__}, not batches; "
                f"each named set is an iterable of global batches or a dp.Batches."
            )
        sets.append((f"{name}_", batches))
    return sets


def positive(api: str, name: str, value: int | None, what: str) -> int | None:
    """``value`` (an int >= 1) or None; else an error naming ``name`` and ``what`` it is."""
    return None if value is None else count(api, name, value, what, ", or None")


def count(api: str, name: str, value: int, what: str, alternative: str = "") -> int:
    """``value``, an int >= 1; else an error naming ``name`` and ``what`` it is."""
    value = check_static_int(api, name, value)
    if value < 1:
        raise ValueError(f"{api}: {name}={value} must be a positive {what}{alternative}.")
    return value


def check_checkpoint(api: str, checkpoint: Any, callbacks: list[Callback]) -> None:
    """``checkpoint`` is a :class:`~jaxcoll.dp.Checkpointer` or None, and not None where a
    callback asks to save (``asks_to_save``, as :class:`~jaxcoll.dp.SaveBest`)."""
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
    savers = [type(cb).__name__ for cb in callbacks if cb.asks_to_save]
    if checkpoint is None and savers:
        raise ValueError(
            f"{api}: the callback {savers[0]} asks to save checkpoints, and fit has no "
            f"checkpoint=; pass checkpoint=dp.Checkpointer(directory, every=None) (saves "
            f"only when a callback asks) or every=k (also every k steps and at the end)."
        )
