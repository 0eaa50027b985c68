"""The Trainer's loss: what the user passes (a ``loss_fn`` or a :class:`~jaxcoll.dp.Model`)
in the step's one form, ``loss(params, model_state, batch, rng, step) -> (loss, (metrics,
model_state))``, its output checked; and the optimizer it steps. (The step builder traces it
with the layout's names in force: :mod:`jaxcoll.dp.step.build`.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from ..adapters import Model, name_of
from ..checks import accepts, loss_output, model_output

# loss_fn(params, batch, rng) -> (loss, metrics); it may take a keyword argument ``step``.
LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def step_loss(api: str, loss_fn: Any) -> tuple[Model | None, Callable]:
    """``(the dp.Model or None, the step's loss)`` for what a Trainer was given."""
    if isinstance(loss_fn, Model):
        model: Model | None = loss_fn
        loss = _of_model(loss_fn)
    elif callable(loss_fn):
        model, loss = None, _stateless(loss_fn)
    else:
        raise TypeError(
            f"{api}: loss_fn must be a callable loss_fn(params, batch, rng) or a "
            f"dp.Model adapter, got {type(loss_fn).__name__} instead."
        )
    return model, loss


def check_optimizer(api: str, optimizer: Any) -> optax.GradientTransformation:
    if isinstance(optimizer, optax.MultiSteps):
        return optimizer.gradient_transformation()
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    hint = ""
    if callable(optimizer) and getattr(optimizer, "__module__", "").startswith("optax"):
        hint = (
            f" (optax.{optimizer.__name__} is a function: call it, e.g. "
            f"optax.{optimizer.__name__}(1e-3))"
        )
    raise TypeError(
        f"{api}: optimizer must be an optax.GradientTransformation (e.g. "
        f"optax.adam(1e-3)) or an optax.MultiSteps, got "
        f"{type(optimizer).__name__} instead{hint}."
    )


def _stateless(loss_fn: LossFn):
    """``loss_fn(params, batch, rng[, step=])`` as the step's loss, its output checked."""
    who = f"loss_fn {name_of(loss_fn)}"
    takes_step = accepts(loss_fn, "step")

    def loss(params, model_state, batch, rng, step):
        out = loss_fn(params, batch, rng, step=step) if takes_step else loss_fn(params, batch, rng)
        value, metrics = loss_output(who, out)
        return value, (metrics, model_state)

    return loss


def _of_model(model: Model):
    """A :class:`~jaxcoll.dp.Model`'s loss_fn as the step's loss, its output checked."""
    who = f"{type(model).__name__}.loss_fn"
    takes_step = accepts(model.loss_fn, "step")

    def loss(params, model_state, batch, rng, step):
        kwargs = {"step": step} if takes_step else {}
        return model_output(who, model.loss_fn(params, model_state, batch, rng, **kwargs))

    return loss
