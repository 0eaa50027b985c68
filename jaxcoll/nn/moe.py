"""MoE: a mixture-of-experts MLP, its experts split over the expert axis (the flax layer of
:func:`jaxcoll.parallel.moe_mlp`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen
from flax.typing import Dtype, Initializer

from .. import parallel
from .._core import roles
from .._core.roles import Role
from .._core.typing import AxisName
from ..parallel.moe.metrics import update_expert_bias
from ..parallel.moe.mlp import run_moe_mlp
from . import _params
from .mlp import ParallelMLP

BIAS = "moe_bias"  # the collection of the routing bias (bias_update_rate)


class MoE(linen.Module):
    """A mixture of experts: each token goes through ``k`` of ``num_experts`` MLPs, chosen by
    a router, and (optionally) a shared expert every token goes through.

    The layer of :func:`jaxcoll.parallel.moe_mlp` (its semantics, routing, capacity and
    checks: one call into it), plus the shared expert::

        y, load = parallel.moe_mlp(x, router, w_in, w_out, k=k, ...)
        y = y + shared(x)                               # a ParallelMLP, when shared_hidden

    Params, declared whole and boxed with their split (``axis_name`` is a role: inside a
    ``dp.Trainer`` the layout's expert axis, which borrows the data-shard devices;
    ``tensor_axis_name`` the layout's tensor axis)::

        router  (d, E)          (None, None)                         replicated
        w_in    (E, d, hidden)  (axis_name, None, tensor_axis_name)  expert e on rank
        w_out   (E, hidden, d)  (axis_name, tensor_axis_name, None)      e // (E / n)
        shared/ fc1, fc2        a ParallelMLP(d, shared_hidden, use_bias=False)

    Under ``jax.shard_map`` with ``axis_name`` bound, each device runs its own experts on the
    tokens routed to them: one ragged all-to-all takes the tokens there and one brings the
    outputs back (two more in the backward). Where ``axis_name`` is not bound every expert is
    local and nothing travels. Where ``tensor_axis_name`` is bound too (expert tensor
    parallel: a layout with a tensor role), each device holds ``hidden / t`` of its experts'
    hidden units, routes and exchanges the same tokens as the other devices of the tensor
    axis, and one all-reduce over it sums the partial outputs, on ``(B, S, d)`` (one more in
    the backward), as the shared expert's does: each device holds ``1 / t`` of the expert
    bytes and does ``1 / t`` of their work. (Asking for the tensor axis, the layer makes a
    ``dp.Trainer`` run that axis by hand; in a model whose other layers leave it to XLA
    (written for GSPMD), pass ``tensor_axis_name=None`` and no ``shared_hidden``.)

    Each call sows its :class:`~jaxcoll.parallel.Load` (the assignments per expert and the
    kept ones over the whole batch, and the load-balancing loss) in the ``"intermediates"``
    collection; :func:`jaxcoll.parallel.moe_metrics` reads them: apply the model with
    ``mutable=["intermediates"]`` and add ``aux_weight * metrics["moe_aux"]`` to the loss.
    In an nnx model (the layer bridged, ``nnx.bridge.ToNNX(MoE(...), rngs=rngs).lazy_init(x)``)
    call it as ``moe(x, mutable=["intermediates"])``: the load is then an ``nnx.Intermediate``
    of the model, which :func:`jaxcoll.nn.pop_moe_metrics` turns into the same metrics.

    The load and the auxiliary loss are those of the batch the step computes: with a
    Trainer's ``accum_steps=k``, of each micro-batch, which is the global rows ``j, j + k,
    ...`` on every layout (each device holds its share of them), so every layout computes
    what one device does; without accumulation, the whole batch's.

    Attributes:
        num_experts: the routed experts, E (the expert axis must divide it).
        hidden: each expert's hidden width.
        k: experts per token, ``1 <= k <= num_experts``.
        axis_name: the expert axis (a role or a mesh axis); None: every expert local.
        tensor_axis_name: the axis each routed expert's hidden units are split over (a role
            or a mesh axis; ``hidden`` must divide by its size); None: each device holds
            its experts whole (the shared expert is split over the tensor axis either way).
        data_axis_name: the axes the tokens are split over, for the load and the auxiliary
            loss over the whole batch (the role ``"batch"``: inside a Trainer, its data
            axes); None or not bound: this device's tokens.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        normalize: divide the chosen gates by their sum.
        capacity_factor: None: dropless; else the per-sequence capacity factor, a positive
            number.
        buffer_factor: dropless at bounded memory (``capacity_factor=None``): None (the
            default), each device's receive buffer has room for every assignment of every
            device; a positive number sizes it ``factor`` times the balanced load and sends
            what does not fit in further rounds, dropping nothing (see
            :func:`jaxcoll.parallel.moe_mlp`).
        shared_hidden: the shared expert's hidden width (None: no shared expert). It is a
            :class:`ParallelMLP`, split over the tensor axis where one is bound.
        activation: the experts' nonlinearity (torch's exact ``nn.GELU()``).
        kernel_init: the experts' initializer (per expert: fan-in ``d`` or ``hidden``).
        router_init: the router's initializer.
        dtype: the experts' computation dtype (None: the input's); the router computes in
            float32.
        param_dtype: the params' dtype.
        groups: node-limited routing: the experts as ``groups`` contiguous groups (one per
            node), each token choosing in its ``group_limit`` best groups only (DeepSeek-V3's
            ``n_group`` and ``topk_group``; :func:`jaxcoll.parallel.moe_mlp`). None: no limit.
        group_limit: the groups each token may use, with ``groups``.
        hierarchical: with ``axis_name`` a pair ``(outer, inner)`` of mesh axes (across
            processes, within one), the two-level exchange: each token crosses ``outer`` once
            per node holding some of its experts (:mod:`jaxcoll.parallel.moe.hierarchical`);
            equal to the flat exchange in value and gradient.
        bias_update_rate: None (the default): route by the scores alone. A positive number:
            DeepSeek-V3's auxiliary-loss-free load balancing, at this rate (its gamma,
            0.001 there): the layer keeps a routing bias ``(E,)`` (float32, zeros at init)
            in the collection ``"moe_bias"`` (``bias`` there), outside the params. Each
            token's experts are the top ``k`` of ``scores + bias``; the gates stay the
            unbiased scores, and the bias gets no gradient. Applied with ``"moe_bias"``
            mutable, the call then writes ``bias + rate * sign(mean(routed) - routed)``
            (:func:`~jaxcoll.parallel.moe.metrics.update_expert_bias`): each expert's bias
            rises where it was chosen less than the mean over the whole batch, falls where
            more. The load is summed over the data axes, so every device and every layout
            computes the same new bias; applied without it (evaluation) the bias is read,
            not stepped. The auxiliary loss still comes in the :class:`Load`: leave it out of
            the loss (or keep a small weight, DeepSeek-V3's sequence-wise loss's role).

    Auxiliary-loss-free balancing in a training loop: ``init`` returns the ``"moe_bias"``
    collection beside the params; apply with ``mutable=["intermediates", "moe_bias"]`` in
    training (the updated bias is returned, carry it to the next step) and with
    ``mutable=["intermediates"]`` in evaluation. In a ``dp.Trainer`` the collection is the
    model state: a ``dp.Model`` whose ``loss_fn(params, model_state, batch, rng)`` applies
    ``{"params": params, **model_state}`` that way (``rng`` None in evaluation) and returns
    the new ``model_state``, or ``dp.Linen`` (which makes every collection ``init`` returned
    mutable in training). With ``accum_steps=k`` the bias steps after each micro-batch (k
    times a step; divide the rate by k for the same drift), from the micro-batch's load,
    the same sequences on every layout. In an nnx model the bridged layer holds the bias
    as ``moe.bias`` (a variable of type ``moe_bias``): call it with
    ``mutable=["intermediates", "moe_bias"]`` in training, where the model's own state
    carries it (``nnx.jit``); ``dp.Nnx`` carries only ``nnx.BatchStat`` as model state.

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
    bias_update_rate: float | None = None
    tensor_axis_name: str | None = Role.TENSOR
    buffer_factor: float | None = None
    groups: int | None = None
    group_limit: int | None = None
    hierarchical: bool = False

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
        w_in, w_out = self._experts(api, num, hidden, d, ranks)
        x, w_in, w_out = linen.dtypes.promote_dtype(x, w_in, w_out, dtype=self.dtype)
        bias = self._routing_bias(api, num)
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
            bias=None if bias is None else bias.value,
            tensor_axis_name=self.tensor_axis_name,
            buffer_factor=self.buffer_factor,
            groups=self.groups,
            group_limit=self.group_limit,
            hierarchical=self.hierarchical,
        )
        rate = self.bias_update_rate
        if bias is not None and rate is not None and self._steps_bias():
            bias.value = update_expert_bias(bias.value, load, rate)
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

    def _experts(
        self, api: str, num: int, hidden: int, d: int, ranks: int | None
    ) -> tuple[jax.Array, jax.Array]:
        """The experts' kernels ``w_in`` ``(E, d, hidden)`` and ``w_out`` ``(E, hidden, d)``,
        declared whole and boxed with their split (the experts over ``axis_name``, the hidden
        units over ``tensor_axis_name``); where those axes are bound, this device's slices
        (``ranks``: the expert axis's size), their initial values this device's slices of the
        whole initial values of its experts."""
        tensor = roles.axis(self.tensor_axis_name)
        parts = _params.split_ranks(self, api, "hidden", hidden, tensor)
        local, width = num // (ranks or 1), hidden // (parts or 1)
        # the specs name the roles (the Trainer resolves them), plainly
        expert, split = (
            n.value if isinstance(n, Role) else n for n in (self.axis_name, self.tensor_axis_name)
        )

        def declare(name: str, shape: tuple[int, ...], dim: int) -> jax.Array:
            spec = tuple(expert if i == 0 else split if i == dim else None for i in range(3))

            def boxed(key: jax.Array, local_shape: tuple[int, ...], dtype: Dtype) -> _params.Split:
                # nn.with_partitioning's box, naming the argument its expert dimension is
                whole = tuple(hidden if i == dim else n for i, n in enumerate(local_shape))
                value = self.kernel_init(key, whole, dtype)  # fan-in of the whole hidden
                if parts is not None:  # this tensor rank's hidden units of its experts
                    at = jax.lax.axis_index(tensor) * width
                    value = jax.lax.dynamic_slice_in_dim(value, at, width, dim)
                return _params.Split(value, spec, layer=api, argname="num_experts", size=num)

            return _params._plain(self.param(name, boxed, shape, self.param_dtype, unbox=False))

        return declare("w_in", (local, d, width), 2), declare("w_out", (local, width, d), 1)

    def _routing_bias(self, api: str, num: int) -> linen.Variable | None:
        """The routing bias's variable (``"moe_bias"``/``"bias"``, ``(num,)`` zeros at init)
        when ``bias_update_rate`` is set, else None; raise ValueError for a rate that is not
        a positive number."""
        rate = self.bias_update_rate
        if rate is None:
            return None
        number = isinstance(rate, (int, float, np.integer, np.floating)) and not isinstance(
            rate, bool
        )
        if not (number and math.isfinite(rate) and rate > 0):
            raise ValueError(
                f"{api}: bias_update_rate={rate!r} must be a positive number (each training "
                f"step moves each expert's routing bias by it; DeepSeek-V3 uses 0.001), or None "
                f"(no routing bias)."
            )
        return self.variable(BIAS, "bias", jnp.zeros, (num,), jnp.float32)

    def _steps_bias(self) -> bool:
        """Whether this call writes the stepped routing bias: ``"moe_bias"`` mutable (in
        training), and not at init (the bias starts at zeros)."""
        return self.is_mutable_collection(BIAS) and not self.is_initializing()
