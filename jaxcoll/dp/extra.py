"""Extra train state: what a step carries and updates besides params and optimizer state.

An :class:`Extra` is an optax-like pair of pure functions (``init``, ``update``) whose state
lives in :attr:`TrainState.extra <jaxcoll.dp.TrainState.extra>`: checkpointed, replicated,
updated inside the jitted step right after the optimizer. :func:`ema` (an exponential
moving average of the params) is the worked example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._core.typing import PyTree
from .state import TrainState


class Extra(NamedTuple):
    """State a :class:`~jaxcoll.dp.Trainer` carries and updates once per step.

    Attributes:
        init: ``init(params) -> extra``: the initial extra state from the initial params
            (called by :meth:`Trainer.init`; must return new arrays, not ``params`` itself,
            as the step donates its buffers).
        update: ``update(extra, state, metrics) -> extra``: called inside the jitted step,
            in the global view, after the optimizer update; ``state`` is the state after
            this step (:class:`~jaxcoll.dp.TrainState`: the new params and model state,
            ``state.step`` the steps taken with this one, ``state.extra`` the old extra),
            ``metrics`` the step's global means (``loss`` and the loss's metrics). The
            result is replicated.

    Example: the number of steps whose loss was above 1::

        >>> count_high = dp.Extra(init=lambda params: jnp.zeros((), jnp.int32),
        ...                       update=lambda n, state, m: n + (m["loss"] > 1))
        >>> trainer = dp.Trainer(loss_fn, optax.sgd(0.1), extra=count_high)
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, TrainState, dict[str, jax.Array]], PyTree]


def ema(decay: float | Callable[[jax.Array], jax.Array]) -> Extra:
    """An exponential moving average of the params, updated after every step.

    Equivalent to, after each optimizer step::

        ema = decay * ema + (1 - decay) * params      # leaf by leaf, in the params' dtype

    starting from a copy of the initial params. Evaluate it with the model's own code by
    swapping it in: ``trainer.evaluate(state.replace(params=state.extra), test)``.

    Args:
        decay: the decay, or a schedule ``decay(step) -> float`` of the number of steps taken,
            this one included (1 at the first update), e.g.
            ``lambda s: jnp.minimum(0.999, (1 + s) / (10 + s))``, the warm-up of TensorFlow's
            ``ExponentialMovingAverage``.

    Returns:
        An :class:`Extra` for ``Trainer(..., extra=ema(0.999))``; ``state.extra`` is the
        averaged params tree.
    """
    if not callable(decay):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
            raise ValueError(
                f"dp.ema: decay={decay!r} must be a number in [0, 1] or a schedule decay(step)."
            )

    def init(params: PyTree) -> PyTree:
        return jax.tree_util.tree_map(jnp.copy, params)

    def update(average: PyTree, state: TrainState, metrics: dict[str, jax.Array]) -> PyTree:
        d = decay(state.step) if callable(decay) else decay
        return jax.tree_util.tree_map(
            lambda a, p: (d * a + (1 - d) * p).astype(a.dtype), average, state.params
        )

    return Extra(init, update)
