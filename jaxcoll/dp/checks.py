"""What the Trainer checks about the user's code and values, with messages that name the fix.

Five kinds of check, each raised where the mistake is made:

* the loss's return value (:func:`loss_output`), checked when the step is traced, so a
  bare scalar, a ``None``, a string or a per-example array in the metrics is reported as
  such instead of as a failure deep inside the step;
* params that cannot be trained (:func:`float_params`): an integer or boolean leaf, or one
  that is no array at all (a string, an object), checked
  by ``Trainer.init`` and when the step is traced, instead of failing inside ``jax.grad``
  with a message that names no leaf;
* a state whose buffers were donated to an earlier step (:func:`check_state`), checked before
  dispatch: calling a jitted program with donated buffers can kill the process;
* a collective over an axis the Trainer does not have (:func:`unbound_axis`): a BatchNorm
  built with ``axis_name="batch"`` under a Trainer over ``"data"``;
* a keyword that is gone (:func:`removed_keywords`): a TypeError naming what replaced it.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .._core.typing import PyTree
from .state import TrainState

RETURN_HINT = (
    "return (loss, metrics): the per-example mean loss, a scalar, and a dict of "
    "scalar metrics (per-example means too), e.g. `return loss, {}`"
)


_T = TypeVar("_T")


def removed_keywords(**replacements: str) -> Callable[[_T], _T]:
    """A decorator for a class (its ``__init__``) or an ``__init__``: a keyword named in
    ``replacements`` raises TypeError naming what replaced it (the value), where Python would
    say only that it is unexpected. The signature shown stays the function's own.

    Example::

        >>> @removed_keywords(axis_name="name the data axes in the layout: layout=...")
        ... def __init__(self, loss_fn, *, layout=None): ...
    """

    def decorate(target: _T) -> _T:
        init: Any = target.__init__ if isinstance(target, type) else target  # type: ignore[misc]

        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            for name in sorted(replacements.keys() & kwargs.keys()):
                api = getattr(self, "api", type(self).__name__)
                raise TypeError(f"{api}: {name}= is gone; {replacements[name]}.")
            init(self, *args, **kwargs)

        if isinstance(target, type):
            setattr(target, "__init__", checked)  # noqa: B010
            return target
        return checked  # type: ignore[return-value]

    return decorate


class LossOutputError(Exception):
    """A loss returned something the Trainer cannot use. The Trainer re-raises it as
    ``kind`` (TypeError or ValueError) with the name of the op that traced the loss."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` can be called with the keyword argument ``name`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    p = params.get(name)
    return p is not None and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def _describe(x: Any) -> str:
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a {len(np.shape(x))}-d array of shape {tuple(np.shape(x))} ({x.dtype})"
    return f"a {type(x).__name__}"


def loss_output(who: str, out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``out`` checked as ``(loss, metrics)``: a real scalar and a dict of numeric scalars.

    Args:
        who: the function that returned ``out``, as the message should name it.
        out: what it returned.

    Returns:
        ``(loss, metrics)`` with ``metrics`` a plain dict (``None`` becomes ``{}``).

    Raises:
        LossOutputError: anything else, with the fix.
    """
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        if hasattr(out, "shape") and np.shape(out) == ():
            raise LossOutputError(
                TypeError,
                f"{who} returned a bare loss ({_describe(out)}) "
                f"instead of (loss, metrics); {RETURN_HINT}.",
            )
        raise LossOutputError(
            TypeError, f"{who} returned {_describe(out)} instead of (loss, metrics); {RETURN_HINT}."
        )
    loss, metrics = out
    if not (hasattr(loss, "shape") or isinstance(loss, (int, float))):
        raise LossOutputError(
            TypeError, f"{who} returned a loss that is {_describe(loss)}; {RETURN_HINT}."
        )
    if np.shape(loss) != ():
        raise LossOutputError(
            ValueError,
            f"{who} returned a loss of shape "
            f"{tuple(np.shape(loss))}; the loss must be a scalar: "
            f"the mean over the batch (e.g. jnp.mean(...)).",
        )
    if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        raise LossOutputError(
            TypeError,
            f"{who} returned a loss of dtype "
            f"{jnp.result_type(loss)}; it must be a floating "
            f"scalar to be differentiated.",
        )
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        raise LossOutputError(
            TypeError,
            f"{who} returned metrics that are "
            f"{_describe(metrics)}; metrics must be a dict of "
            f"scalars ({{}} for none).",
        )
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise LossOutputError(
                TypeError, f"{who} returned a metric named {name!r}; metric names must be strings."
            )
        if name == "loss":
            raise LossOutputError(
                ValueError,
                f"{who} returned a metric named 'loss', which "
                f"the Trainer reports itself (the returned "
                f"loss); rename the metric.",
            )
        ok = hasattr(value, "dtype") or isinstance(value, (bool, int, float))
        if not ok or not (
            jnp.issubdtype(jnp.result_type(value), jnp.number)
            or jnp.result_type(value) == jnp.bool_
        ):
            raise LossOutputError(
                TypeError,
                f"{who} returned metric {name!r} as "
                f"{_describe(value)}; metrics must be numeric "
                f"scalars (per-example means over the batch).",
            )
        if np.shape(value) != ():
            raise LossOutputError(
                ValueError,
                f"{who} returned metric {name!r} of shape "
                f"{tuple(np.shape(value))}; metrics must be "
                f"scalars, per-example means over the batch (e.g. "
                f"jnp.mean(...)), so the Trainer can average "
                f"them over devices and batches.",
            )
    return loss, dict(metrics)


def model_output(who: str, out: Any) -> tuple[jax.Array, tuple[dict[str, jax.Array], PyTree]]:
    """A :class:`~jaxcoll.dp.Model`'s ``(loss, (metrics, model_state))``, checked."""
    if not (
        isinstance(out, (tuple, list))
        and len(out) == 2
        and isinstance(out[1], (tuple, list))
        and len(out[1]) == 2
    ):
        raise LossOutputError(
            TypeError,
            f"{who} returned {_describe(out)}; a dp.Model's "
            f"loss_fn must return (loss, (metrics, model_state)).",
        )
    loss, metrics = loss_output(who, (out[0], out[1][0]))
    return loss, (metrics, out[1][1])


def float_params(api: str, params: PyTree, grad_route: str) -> None:
    """Raise TypeError if a leaf of ``params`` is not floating (or complex), or is no array
    (nor a Python number) at all: a string or another object.

    Every param is differentiated, its gradient crosses the devices (``grad_route``: how the
    strategy moves it, e.g. reduce-scattered for ZeRO-1 and FSDP) and the optimizer updates
    it; ``jax.grad`` refuses integer and boolean inputs, so such a leaf is named here.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not hasattr(leaf, "dtype") and not isinstance(leaf, numbers.Number):
            shown = repr(leaf) if len(repr(leaf)) <= 60 else repr(leaf)[:57] + "..."
            raise TypeError(
                f"{api}: params{jax.tree_util.keystr(path)} is {shown} (a "
                f"{type(leaf).__name__}), not an array; every leaf of params is a param, "
                f"differentiated by jax.grad and updated by the optimizer. Keep other values "
                f"(names, settings) out of the params: in loss_fn's closure, or as an "
                f"attribute of the model."
            )
        dtype = np.dtype(getattr(leaf, "dtype", None) or np.result_type(leaf))
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"{api}: params{jax.tree_util.keystr(path)} has dtype {dtype}, but every param "
                f"is trained: differentiated by jax.grad, its gradient {grad_route}, and "
                f"updated by the optimizer, which needs a floating dtype. Cast it (e.g. "
                f"jnp.float32) if it should train; keep it out of the params if it should not: "
                f"a constant in loss_fn's closure, or model state with a dp.Model (a linen "
                f"collection other than 'params', an nnx Variable that is not an nnx.Param)."
            )


def check_flag(api: str, argname: str, value: Any) -> bool:
    """``value`` as a bool; raise TypeError unless it is one (a string such as ``"no"`` is
    truthy, so it is not read)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{api}: {argname} must be True or False, got {value!r} of type "
            f"{type(value).__name__} instead (a string such as 'no' is truthy)."
        )
    return bool(value)


def check_state(api: str, state: Any) -> None:
    """``state`` must be a live :class:`~jaxcoll.dp.TrainState` (see :func:`check_live`)."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"{api}: state must be the TrainState that Trainer.init returned, got "
            f"{type(state).__name__} instead."
        )
    check_live(api, state)


def check_live(api: str, state: PyTree) -> None:
    """Raise if any array of ``state`` was deleted (donated to an earlier step)."""
    for leaf in jax.tree_util.tree_leaves(state):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(
                f"{api}: the state passed was donated to an earlier Trainer.step (its buffers "
                f"are deleted; a step consumes the state it is given when donate=True). Use "
                f"the state that step returned (`state, metrics = trainer.step(state, batch)`), "
                f"or build the Trainer with donate=False to keep old states alive."
            )


def unbound_axis(exc: BaseException, axes: tuple) -> Any:
    """The axis name a failed trace reduced over that is not one of ``axes``, or None.

    A collective over an axis the program does not bind fails inside jax with an error that
    names neither the layer nor the fix (``NameError: unbound axis name``, or a bare
    ``AssertionError``). The frames of the failing call still hold the ``axis_name`` the
    layer passed (flax's BatchNorm, ``lax.pmean``); the first one that names an axis outside
    ``axes`` is the culprit.
    """
    tb = exc.__traceback__
    while tb is not None:
        value = tb.tb_frame.f_locals.get("axis_name")
        names = value if isinstance(value, (tuple, list)) else (value,)
        if value is not None and all(isinstance(a, str) for a in names):
            missing = [a for a in names if a not in axes]
            if missing:
                return missing[0]
        tb = tb.tb_next
    return None


def as_path(api: str, argname: str, value: Any, of: str = "") -> str:
    """``value`` (a str or ``os.PathLike``) as an absolute path; else a TypeError naming
    ``argname`` (``of``: what it must be the path of, e.g. ``" of a PNG"``)."""
    try:
        return os.path.abspath(os.fspath(value))
    except TypeError:
        raise TypeError(
            f"{api}: {argname} must be a path (str or os.PathLike){of}, got "
            f"{type(value).__name__} instead."
        ) from None
