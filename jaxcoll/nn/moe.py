"""MoE: a mixture-of-experts MLP, its experts split over the expert axis (the flax layer of
:func:`jaxcoll.parallel.moe_mlp`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen
from flax.typing import Dtype, Initializer

from .. import parallel
from .._core import roles
from .._core.roles import Role
from .._core.typing import AxisName
from ..parallel.moe.mlp import run_moe_mlp
from . import _params
from .mlp import ParallelMLP


class MoE(linen.Module):
    """A mixture of experts: each token goes through ``k`` of ``num_experts`` MLPs, chosen by
    a router, and (optionally) a shared expert every token goes through.

    The layer of :func:`jaxcoll.parallel.moe_mlp` (its semantics, routing, capacity and
    checks: one call into it), plus the shared expert::

        y, load = parallel.moe_mlp(x, router, w_in, w_out, k=k, ...)
        y = y + shared(x)                               # a ParallelMLP, when shared_hidden

    Params, declared whole and boxed with their split (``axis_name`` is a role: inside a
    ``dp.Trainer`` the layout's expert axis, which borrows the data-shard devices)::

        router  (d, E)          (None, None)             replicated
        w_in    (E, d, hidden)  (axis_name, None, None)  expert e on rank e // (E / n)
        w_out   (E, hidden, d)  (axis_name, None, None)
        shared/ fc1, fc2        a ParallelMLP(d, shared_hidden, use_bias=False)

    Under ``jax.shard_map`` with ``axis_name`` bound, each device runs its own experts on the
    tokens routed to them: one ragged all-to-all takes the tokens there and one brings the
    outputs back (two more in the backward). Where ``axis_name`` is not bound every expert is
    local and nothing travels.

    Each call sows its :class:`~jaxcoll.parallel.Load` (the assignments per expert and the
    kept ones over the whole batch, and the load-balancing loss) in the ``"intermediates"``
    collection; :func:`jaxcoll.parallel.moe_metrics` reads them: apply the model with
    ``mutable=["intermediates"]`` and add ``aux_weight * metrics["moe_aux"]`` to the loss.
    In an nnx model (the layer bridged, ``nnx.bridge.ToNNX(MoE(...), rngs=rngs).lazy_init(x)``)
    call it as ``moe(x, mutable=["intermediates"])``: the load is then an ``nnx.Intermediate``
    of the model, which :func:`jaxcoll.nn.pop_moe_metrics` turns into the same metrics.

    The load and the auxiliary loss are those of the batch the step computes: with a
    Trainer's ``accum_steps``, of each micro-batch, and since each device splits its own
    rows into micro-batches, which sequences share one depends on the layout (the loss is a
    product of two means over them); without accumulation every layout computes the same.

    Attributes:
        num_experts: the routed experts, E (the expert axis must divide it).
        hidden: each expert's hidden width.
        k: experts per token, ``1 <= k <= num_experts``.
        axis_name: the expert axis (a role or a mesh axis); None: every expert local.
        data_axis_name: the axes the tokens are split over, for the load and the auxiliary
            loss over the whole batch (the role ``"batch"``: inside a Trainer, its data
            axes); None or not bound: this device's tokens.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        normalize: divide the chosen gates by their sum.
        capacity_factor: None: dropless; else the per-sequence capacity factor, a positive
            number.
        shared_hidden: the shared expert's hidden width (None: no shared expert). It is a
            :class:`ParallelMLP`, split over the tensor axis where one is bound.
        activation: the experts' nonlinearity (torch's exact ``nn.GELU()``).
        kernel_init: the experts' initializer (per expert: fan-in ``d`` or ``hidden``).
        router_init: the router's initializer.
        dtype: the experts' computation dtype (None: the input's); the router computes in
            float32.
        param_dtype: the params' dtype.

    Example (one device; inside a ``dp.Trainer`` with ``Layout(shard=8, expert=8)`` the same
    model runs its experts over 8 devices)::

        >>> moe = MoE(num_experts=8, hidden=64, k=2)
        >>> x = jnp.ones((2, 16, 32))
        >>> variables = moe.init(jax.random.key(0), x)
        >>> y, sown = moe.apply(variables, x, mutable=["intermediates"])
        >>> y.shape, sorted(parallel.moe_metrics(sown["intermediates"]))
        ((2, 16, 32), ['moe_aux', 'moe_dropped', 'moe_imbalance'])
    """

    num_experts: int
    hidden: int
    k: int = 2
    axis_name: str | None = Role.EXPERT
    data_axis_name: AxisName | None = "batch"
    score_func: str = "softmax"
    normalize: bool = False
    capacity_factor: float | None = None
    shared_hidden: int | None = None
    activation: Callable[[jax.Array], jax.Array] = parallel.gelu
    kernel_init: Initializer = linen.initializers.lecun_normal(batch_axis=(0,))
    router_init: Initializer = linen.initializers.normal(0.02)
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        api = _params.where(self)
        num = _params.positive_int(api, "num_experts", self.num_experts)
        hidden = _params.positive_int(api, "hidden", self.hidden)
        axis = roles.axis(self.axis_name)
        ranks = _params.bound_size(axis)
        _params.divides(api, "num_experts", num, ranks, axis)
        d = jnp.shape(x)[-1] if jnp.ndim(x) else 1  # a scalar x: run_moe_mlp refuses it
        router: Any = self.param(
            "router",
            linen.with_partitioning(self.router_init, (None, None)),
            (d, num),
            self.param_dtype,
        )
        name = self.axis_name  # the spec names the role (the Trainer resolves it), plainly
        split = (name.value if isinstance(name, Role) else name, None, None)

        def boxed(key: jax.Array, shape: tuple[int, ...], dtype: Dtype) -> _params.Split:
            # nn.with_partitioning's box, naming the argument its split dimension is
            value = self.kernel_init(key, shape, dtype)
            return _params.Split(value, split, layer=api, argname="num_experts", size=num)

        local = num // (ranks or 1)  # where the axis is bound, this device's experts
        w_in = _params._plain(
            self.param("w_in", boxed, (local, d, hidden), self.param_dtype, unbox=False)
        )
        w_out = _params._plain(
            self.param("w_out", boxed, (local, hidden, d), self.param_dtype, unbox=False)
        )
        x, w_in, w_out = linen.dtypes.promote_dtype(x, w_in, w_out, dtype=self.dtype)
        y, load = run_moe_mlp(
            api,
            x,
            router,
            w_in,
            w_out,
            k=self.k,
            axis_name=self.axis_name,
            data_axis_name=self.data_axis_name,
            score_func=self.score_func,
            normalize=self.normalize,
            capacity_factor=self.capacity_factor,
            activation=self.activation,
        )
        self.sow("intermediates", "moe_load", load)
        if self.shared_hidden is not None:
            shared = ParallelMLP(
                features=d,
                hidden=self.shared_hidden,
                use_bias=False,
                activation=self.activation,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="shared",
            )
            y = y + shared(x)
        return y
