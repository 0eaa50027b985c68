"""Mixed precision as a value: what dtype the params are gathered and computed in, and what dtype
the gradients are reduced in (torch FSDP2's ``MixedPrecisionPolicy``).

The train state keeps the params and the optimizer state in their own dtype (fp32 master
weights); a policy only decides what crosses the devices and what the loss computes with. It
is a field of every strategy: ``dp.sync.FSDP(mp_policy=dp.sync.MixedPrecisionPolicy(
param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from ..._core.checks import check_dtype, check_optional
from ..._core.typing import PyTree


def _floating(name: str, value: Any) -> Any:
    return check_dtype(
        "dp.sync.MixedPrecisionPolicy",
        name,
        value,
        lambda dt: jnp.issubdtype(dt, jnp.floating),
        "a floating dtype such as jnp.bfloat16 or jnp.float32",
    )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """What the strategy casts, and where (torch FSDP2's ``MixedPrecisionPolicy``:
    ``param_dtype`` and ``reduce_dtype`` with torch's meaning and defaults).

    * ``param_dtype``: the dtype the loss computes with. Every floating param is cast to it
      on its way to the loss: FSDP and HSDP cast each device's *slice* before the
      all-gather, so the gather moves ``param_dtype`` bytes (half of fp32's for bfloat16);
      DDP and ZeRO-1 cast the replicated params at the start of the loss. The gradient of
      the cast is the ``param_dtype`` gradient, in the params' own dtype. None: no cast.
    * ``reduce_dtype``: the dtype the gradients cross the devices in (each rank's gradient
      cast, summed, cast back to the params' dtype, and divided by n: by FSDP, HSDP and
      ZeRO-1 after the sum when this is the params' dtype, else before the cast, as DDP
      always does). None: ``param_dtype``
      (torch's default), or the gradients' own dtype when that is None too. With
      ``param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32`` the synchronised gradient is
      the fp32 mean of the per-device bfloat16 gradients.
    * ``cast_batch``: cast the floating leaves of the batch to ``param_dtype`` too, so the
      model computes in it (JAX promotes a bfloat16 weight times an fp32 input to fp32).
      Integer inputs (token ids) are never cast. Not torch's ``cast_forward_inputs``, hence
      its own name: the batch is what the whole loss takes, so floating *targets* are cast
      as well (torch casts the module's inputs, and its loss sees fp32 targets); pass
      ``cast_batch=False`` and cast the inputs in the model to keep fp32 targets.

    The params, the update and the optimizer state stay in the params' own dtype (fp32
    master weights). A strategy takes a policy or a communication ``hook``, not both: both
    say what the gradients travel in.

    Example::

        >>> policy = dp.sync.MixedPrecisionPolicy(param_dtype=jnp.bfloat16,
        ...                                  reduce_dtype=jnp.float32)
        >>> trainer = dp.Trainer(loss_fn, optax.adamw(1e-3),
        ...                      sync=dp.sync.FSDP(mp_policy=policy))
    """

    param_dtype: DTypeLike | None = None
    reduce_dtype: DTypeLike | None = None
    cast_batch: bool = True

    def __post_init__(self) -> None:
        api = "dp.sync.MixedPrecisionPolicy"
        object.__setattr__(self, "param_dtype", _floating("param_dtype", self.param_dtype))
        object.__setattr__(self, "reduce_dtype", _floating("reduce_dtype", self.reduce_dtype))
        if not isinstance(self.cast_batch, bool):
            raise TypeError(
                f"{api}: cast_batch must be True or False, got {self.cast_batch!r} instead."
            )

    @property
    def wire_dtype(self) -> Any:
        """The dtype the gradients cross the devices in: ``reduce_dtype``, else
        ``param_dtype``; None: the gradients' own."""
        return self.param_dtype if self.reduce_dtype is None else self.reduce_dtype

    def cast(self, tree: PyTree) -> PyTree:
        """Every floating leaf of ``tree`` in ``param_dtype`` (``tree`` itself when None)."""
        dt = self.param_dtype
        if dt is None:
            return tree

        def one(x: Any) -> Any:
            dtype = getattr(x, "dtype", None)
            if dtype is None or dtype == dt or not jnp.issubdtype(dtype, jnp.floating):
                return x
            return x.astype(dt)

        return jax.tree_util.tree_map(one, tree)

    def compute(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(params, model_state, batch, *rest)`` with the params cast to ``param_dtype``
        (the leaves not yet in it) and, with ``cast_batch``, the batch's floating
        leaves too."""
        if self.param_dtype is None:
            return fn
        inputs = self.cast_batch

        def cast_fn(params: PyTree, model_state: PyTree, batch: PyTree, *rest: Any) -> Any:
            return fn(self.cast(params), model_state, self.cast(batch) if inputs else batch, *rest)

        return cast_fn


def check_policy(api: str, policy: Any, hook: Any) -> None:
    """Raise if ``policy`` is not a :class:`MixedPrecisionPolicy` (or None), or comes with a
    communication hook (both say what the gradients travel in)."""
    check_optional(api, "mp_policy", policy, MixedPrecisionPolicy, "a dp.sync.MixedPrecisionPolicy")
    if policy is not None and hook is not None:
        raise ValueError(
            f"{api}: mp_policy={policy!r} and hook={hook!r} both say what the gradients "
            f"cross the devices in. Pass one: the policy's reduce_dtype (the gradients travel "
            f"in it, as with dp.hooks.Compress(reduce_dtype)), or the hook with no policy."
        )
