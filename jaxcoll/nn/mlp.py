"""ParallelMLP: the Megatron MLP block, its hidden units split over the tensor axis."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen
from flax.typing import Dtype, Initializer

from .. import parallel
from .._core import roles
from .._core.roles import Role
from . import _params


# -------------------------------------------------------------------------------- the MLP
class ParallelMLP(linen.Module):
    """The Megatron MLP block ``activation(x @ W1 + b1) @ W2 + b2``, split over
    ``axis_name``.

    Equivalent to the dense block (flax's ``Dense(hidden, name="fc1")``, the activation,
    ``Dense(features, name="fc2")``; torch's ``Linear``, ``GELU()``, ``Linear``) on the whole
    params::

        def mlp(x):
            return activation(x @ fc1.kernel + fc1.bias) @ fc2.kernel + fc2.bias

    Params, declared whole and boxed by ``flax.linen.with_partitioning`` with these partition
    names (``d = x.shape[-1]``; the names of a dense ``Dense(name="fc1")``, ``"fc2"``)::

        fc1/kernel  (d, hidden)         (None, axis_name)   column-parallel
        fc1/bias    (hidden,)           (axis_name,)
        fc2/kernel  (hidden, features)  (axis_name, None)   row-parallel
        fc2/bias    (features,)         (None,)             replicated, added once after the sum

    (:func:`jaxcoll.parallel.mlp_specs` of ``w1, b1, w2, b2``.) It runs
    :func:`jaxcoll.parallel.mlp` on them. Called where ``axis_name`` is bound (inside
    ``jax.shard_map``; params passed with ``in_specs=flax.linen.get_partition_spec(variables)``),
    each rank computes ``hidden/n`` hidden units with its slices (fc1 column-parallel, no
    communication; fc2 row-parallel). The input is the same on every rank and so is the
    output. Where ``axis_name`` is not bound (outside ``shard_map``, or ``axis_name=None``) it
    is the dense block on whole params, with no collective.

    Communication per call, forward: ONE all-reduce of the output, ``(..., features)``. The
    backward adds its mirror, ONE all-reduce of the input's cotangent (inserted by jax where
    the replicated input meets the split kernel; ``shard_map``'s default ``check_vma=True``).
    With ``sequence_parallel=True``: one all-gather of the input's rows and one reduce-scatter
    of the output's (:func:`jaxcoll.parallel.column_parallel` and
    :func:`~jaxcoll.parallel.row_parallel` with ``scatter=True``), and in the backward one
    reduce-scatter, one all-gather and, with ``use_bias``, an all-reduce of fc2's bias
    gradient ``(features,)`` (the bias is replicated, the rows it meets are each rank's own).

    Attributes:
        features: the output width.
        hidden: the hidden width; must divide by the size of ``axis_name``.
        axis_name: the mesh axis the layer is split over (a role: a ``dp.Trainer``'s layout
            gives it); None for the dense layer everywhere.
        use_bias: give fc1 and fc2 biases (False: nanoGPT's ``bias=False``).
        activation: the nonlinearity; the default is torch's ``nn.GELU()``, the exact GELU
            (:func:`jaxcoll.parallel.gelu`); ``functools.partial(jax.nn.gelu,
            approximate=True)`` is ``nn.GELU(approximate="tanh")``.
        sequence_parallel: under ``shard_map``, the input is this rank's contiguous
            ``1/n`` of the sequence dim (dim -2; the tokens of a ``(tokens, d)`` input) and
            so is the output (Megatron's sequence parallelism). Ignored in dense mode.
        kernel_init: initializer of both kernels (called on the whole, flat kernel).
        bias_init: initializer of both biases.
        dtype: the computation dtype (None: from the input and params).
        param_dtype: the params' dtype.
        out_kernel_init: fc2's own initializer (None: ``kernel_init``), e.g. GPT-2's
            ``normal(0.02 / sqrt(2 * n_layer))`` for ``c_proj``.

    Called as ``module.apply(variables, x)`` with ``x`` of shape ``(..., d)``, it returns the
    output, ``(..., features)``.

    Note:
        ``init`` outside ``jax.shard_map`` declares the whole params; inside it, each rank
        gets its slice of the same whole initial values (computed whole on every rank).
        ``apply`` takes the params boxed (``nn.Partitioned``) or plain.

    Example (4 devices)::

        >>> mesh = jax.sharding.Mesh(jax.devices()[:4], ("tensor",))
        >>> mlp = ParallelMLP(features=16, hidden=64)
        >>> x = jnp.ones((8, 16))
        >>> variables = mlp.init(jax.random.key(0), x)  # whole params, outside shard_map
        >>> specs = flax.linen.get_partition_spec(variables)
        >>> specs["params"]["fc1"]["kernel"]
        P(None, 'tensor')
        >>> split = jax.jit(jax.shard_map(mlp.apply, mesh=mesh, in_specs=(specs, P()),
        ...                               out_specs=P()))
        >>> bool(jnp.allclose(split(variables, x), mlp.apply(variables, x), atol=1e-5))
        True
    """

    features: int
    hidden: int
    axis_name: str | None = Role.TENSOR
    use_bias: bool = True
    activation: Callable[[jax.Array], jax.Array] = parallel.gelu
    sequence_parallel: bool = False
    kernel_init: Initializer = _params.default_kernel_init
    bias_init: Initializer = linen.initializers.zeros_init()
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    out_kernel_init: Initializer | None = None

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        axis = roles.axis(self.axis_name)  # the layout's tensor axis, where one binds
        api = _params.where(self)
        features = _params.positive_int(api, "features", self.features)
        hidden = _params.positive_int(api, "hidden", self.hidden)
        ranks = _params.split_ranks(self, api, "hidden", hidden, axis)
        sp = self.sequence_parallel and ranks is not None
        if jnp.ndim(x) < (2 if sp else 1):
            raise ValueError(
                f"{api}: x has shape {jnp.shape(x)}; it needs a feature dim"
                + (" and a sequence dim (-2) for sequence_parallel=True." if sp else ".")
            )
        d = jnp.shape(x)[-1]
        w1, b1 = _params.linear(
            self, "fc1", ranks, (d, hidden), 1, (hidden,), 0, split_arg="hidden"
        )
        w2, b2 = _params.linear(
            self,
            "fc2",
            ranks,
            (hidden, features),
            0,
            (features,),
            None,
            split_arg="hidden",
            kernel_init=self.out_kernel_init,
        )
        x, w1, b1, w2, b2 = linen.dtypes.promote_dtype(x, w1, b1, w2, b2, dtype=self.dtype)
        params = {"w1": w1, "w2": w2}
        if self.use_bias:
            params |= {"b1": b1, "b2": b2}
        # split where the axis is bound (sequence parallel over dim -2), else dense
        return parallel.mlp(
            params, x, axis, activation=self.activation, sequence_parallel=sp, dim=-2
        )
