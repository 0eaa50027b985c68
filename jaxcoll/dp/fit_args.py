"""``fit``'s arguments, checked and normalised before any step: the step count, the data and
evaluation sets, positive counts, the profile's steps and directory."""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .._core.checks import check_static_int
from .._core.typing import PyTree
from .checkpoint import check_directory
from .data import Batches


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


EvalData = Batches | Iterable[PyTree] | Mapping[str, Batches | Iterable[PyTree]]


def eval_sets(api: str, eval_data: Any) -> list[tuple[str, Any]] | None:
    """``fit``'s ``eval_data`` as ``[(prefix, batches), ...]``: one set with prefix ``""``,
    or named sets (a dict ``{"val": batches, ...}``) with prefixes ``"val_"``, ...."""
    if eval_data is None:
        return None
    if not isinstance(eval_data, Mapping):
        check_data(api, "eval_data", eval_data)
        return [("", eval_data)]
    if any(hasattr(v, "shape") and hasattr(v, "dtype") for v in eval_data.values()):
        raise TypeError(
            f"{api}: eval_data is a dict (one batch?); pass an iterable of global batches, "
            f"e.g. [eval_data], or a dp.Batches; named evaluation sets are a dict of such "
            f"iterables, e.g. {{'val': val_batches, 'train': train_batches}}."
        )
    if not eval_data:
        raise ValueError(
            f"{api}: eval_data is an empty dict; pass named evaluation sets, e.g. "
            f"{{'val': val_batches}}, or None for no evaluation."
        )
    sets = []
    for name, batches in eval_data.items():
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"{api}: eval_data's keys name the evaluation sets (results are keyed "
                f"<name>_<metric>, e.g. 'val_loss') and must be non-empty str, got {name!r} "
                f"of type {type(name).__name__}; pass e.g. {{'val': val_batches}}."
            )
        if isinstance(batches, Mapping):
            raise TypeError(
                f"{api}: eval_data[{name!r}] is a dict (one batch?); each named set is an "
                f"iterable of global batches, e.g. {{{name!r}: [batch]}}, or a dp.Batches."
            )
        if not isinstance(batches, (Batches, Iterable)):
            raise TypeError(
                f"{api}: eval_data[{name!r}] is a {type(batches).__name__}, not batches; "
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


def check_profile(
    api: str, steps: Any, directory: str | os.PathLike | None
) -> tuple[int, int, str] | None:
    """``fit``'s ``profile_steps=(start, stop)`` and ``profile_dir``."""
    if steps is None and directory is None:
        return None
    if steps is None:
        assert directory is not None
        raise ValueError(
            f"{api}: profile_dir={os.fspath(directory)!r} needs profile_steps=(start, stop), "
            f"the steps to trace (e.g. (10, 15): steps 10 to 14)."
        )
    ok = (
        isinstance(steps, (tuple, list))
        and len(steps) == 2
        and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in steps)
    )
    if not ok:
        raise TypeError(
            f"{api}: profile_steps must be a pair of ints (start, stop): the steps start to "
            f"stop - 1 are traced, numbered as callbacks see them (1 is the first); got "
            f"{steps!r}."
        )
    begin, end = int(steps[0]), int(steps[1])
    if not 1 <= begin < end:
        raise ValueError(
            f"{api}: profile_steps={steps!r} must have 1 <= start < stop (the steps start to "
            f"stop - 1 are traced; 1 is the first step, which compiles: (2, 5) skips it)."
        )
    if directory is None:
        raise ValueError(
            f"{api}: profile_steps={steps!r} needs profile_dir=, the directory the trace "
            f"goes to (open it with TensorBoard's profile plugin, or Perfetto)."
        )
    return begin, end, check_directory(api, "profile_dir", directory)
