"""Tensor-parallel flax linen layers: the Megatron MLP and multi-head self-attention.

Each layer declares its params whole (``module.init`` outside ``jax.shard_map`` gives the
dense shapes) and boxed with ``flax.linen.with_partitioning``, so
``flax.linen.get_partition_spec(variables)`` says how to split them over the tensor axis.
Called where that axis is bound (inside ``jax.shard_map``), a layer takes this device's slices
and communicates through :mod:`jaxcoll.parallel`'s ``column_parallel`` / ``row_parallel``
(one all-reduce per layer); called where it is not, it is the dense layer on whole params,
with no collective. One model definition serves the single-device reference and the
tensor-parallel run.

The boxes are ``Split``, flax's ``nn.Partitioned`` that also names the layer's argument
its split dimension is (``hidden``, ``num_heads``): ``dp.Trainer.init`` then reports a split
the tensor axis does not divide in the layer's words, as the layer does when it is
initialised under ``jax.set_mesh`` with that axis, before JAX would fail to place the params.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, struct
from flax.core import meta
from flax.typing import Dtype, Initializer
from jax import lax

from .. import parallel
from .._core import roles
from .._core.checks import check_static_int
from .._core.vma import cast_varying

_default_kernel_init = linen.initializers.lecun_normal()


# ------------------------------------------------------------------------------ the helpers
def _bound_size(axis: str | None) -> int | None:
    """The size of mesh axis ``axis`` where it is bound (tensor-parallel mode), else None
    (dense mode: ``axis=None``, or a name no enclosing ``jax.shard_map`` binds)."""
    if axis is None or not parallel.is_bound(axis):
        return None
    return int(lax.axis_size(axis))
    try:
        return int(lax.axis_size(axis))
    except NameError:
        return None


def _where(module: linen.Module) -> str:
    """The module's class and, below the root, its path: ``ParallelMLP 'block0/mlp'``."""
    path = "/".join(str(p) for p in module.path)
    return f"{type(module).__name__} {path!r}" if path else type(module).__name__


def _positive_int(api: str, argname: str, value: Any) -> int:
    value = check_static_int(api, argname, value)
    if value <= 0:
        raise ValueError(f"{api}: {argname}={value} must be a positive int.")
    return value


_FIX = {  # what to do when the layer's argument does not divide by n
    "hidden": "Pick a hidden width divisible by {n}, or split over an axis whose size divides "
    "{value}.",
    "num_heads": "Each rank owns whole heads: pick a number of heads divisible by {n}, or split "
    "over an axis whose size divides {value}.",
}


def _indivisible(where: str, argname: str, value: int, n: int, axis: str | None) -> str:
    fix = _FIX[argname].format(n=n, value=value)
    return (
        f"{where}: {argname}={value} is not divisible by the {n} ranks of mesh axis {axis!r}, "
        f"over which it is split. {fix}"
    )


def _divides(where: str, argname: str, value: int, n: int | None, axis: str | None) -> None:
    if n is not None and value % n:
        raise ValueError(_indivisible(where, argname, value, n, axis))


def _mesh_size(axis: str | None) -> int | None:
    """The size of ``axis`` in the mesh set by ``jax.set_mesh`` (None if none has it): params
    initialised under it are then placed split over it (``out_shardings`` from their boxes),
    where JAX's own error would name neither the layer nor its argument."""
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None or mesh.empty or axis not in mesh.axis_names:
        return None
    return int(dict(mesh.shape)[axis])


class Split(meta.Partitioned):
    """A param box (flax's ``nn.Partitioned``, as ``nn.with_partitioning`` makes) that also
    knows which argument of its layer sizes its split dimension, so that code placing the
    params (``dp.Trainer.init``) can report a split that does not divide in the layer's words:
    ``indivisible(size, n, axes)`` gives the layer's message, or None where the failing split
    is not the layer's own (another dimension or axis)."""

    layer: str = struct.field(default="", pytree_node=False)  # "ParallelMLP 'block/mlp'"
    argname: str = struct.field(default="", pytree_node=False)  # "hidden", "num_heads"
    size: int = struct.field(default=0, pytree_node=False)  # its value: the split dim's size
    axis: str | None = struct.field(default=None, pytree_node=False)

    def indivisible(self, size: int, n: int, axes: tuple) -> str | None:
        if not self.argname or size != self.size or tuple(axes) != (self.axis,):
            return None
        return _indivisible(self.layer, self.argname, self.size, n, self.axis)


def _plain(value: Any) -> jax.Array:
    """A param's array without its box, and without flax's sharding constraint (these layers
    communicate themselves; inside shard_map the tensor axis is manual)."""
    if isinstance(value, meta.Partitioned):
        return value.unbox(apply_constraint=False)
    return meta.unbox(value)


class _Linear(linen.Module):
    """Declares (does not apply) the kernel and bias of one linear map, split over ``axis``.

    ``kernel_shape`` and ``bias_shape`` are the whole (dense) shapes; the kernel's first
    ``fan_in_dims`` dims are its inputs (it is initialised flat, as ``flax.linen.DenseGeneral``
    does). ``kernel_split`` / ``bias_split`` is the dim split over ``axis`` (None: replicated).
    With ``ranks`` set, the params declared are this rank's slices, and their initial values
    are this rank's slice of the whole initial value.
    """

    api: str
    kernel_shape: tuple[int, ...]
    kernel_split: int | None
    fan_in_dims: int
    bias_shape: tuple[int, ...] | None
    bias_split: int | None
    axis: str | None
    ranks: int | None
    kernel_init: Initializer
    bias_init: Initializer
    param_dtype: Dtype
    split_arg: str = ""  # the layer's argument the split dim's size is ("hidden", "num_heads")

    @linen.compact
    def __call__(self) -> tuple[jax.Array, jax.Array | None]:
        kernel = self._param("kernel", self.kernel_init, self.kernel_shape, self.kernel_split)
        bias = None
        if self.bias_shape is not None:
            bias = self._param("bias", self.bias_init, self.bias_shape, self.bias_split)
        return kernel, bias

    def _param(
        self, name: str, init: Initializer, shape: tuple[int, ...], split: int | None
    ) -> jax.Array:
        n = self.ranks or 1
        local = tuple(s // n if i == split else s for i, s in enumerate(shape))
        fan_in = int(np.prod(shape[: self.fan_in_dims])) if name == "kernel" else 0
        axis = self.axis

        def init_fn(key: jax.Array, local_shape: tuple[int, ...], dtype: Dtype) -> jax.Array:
            if name == "kernel":
                whole = jnp.reshape(
                    init(key, (fan_in, int(np.prod(shape)) // fan_in), dtype), shape
                )
            else:
                whole = init(key, shape, dtype)
            if split is None or local_shape == shape:
                return whole
            size = local_shape[split]
            return lax.dynamic_slice_in_dim(whole, lax.axis_index(axis) * size, size, split)

        if self.has_variable("params", name):
            got = np.shape(jax.tree.leaves(self.get_variable("params", name))[0])
            if got != local:
                where = (
                    f"this rank's slice over mesh axis {axis!r} ({n} ranks)"
                    if self.ranks is not None
                    else "the whole param (dense mode: no tensor axis is bound)"
                )
                raise ValueError(
                    f"{self.api}: param {'/'.join(self.path)}/{name} has shape {got}, but "
                    f"{where} has shape {local}, for the input and the layer's arguments. "
                    f"Initialise the layer outside jax.shard_map with an input of this "
                    f"width, and pass the params with "
                    f"in_specs=flax.linen.get_partition_spec(variables)."
                )
        names = tuple(axis if i == split else None for i in range(len(shape)))

        def boxed_init(key: jax.Array, local_shape: tuple[int, ...], dtype: Dtype) -> Split:
            # nn.with_partitioning's box, which also names the layer's argument it splits
            size = 0 if split is None else shape[split]
            return Split(
                init_fn(key, local_shape, dtype),
                names,
                layer=self.api,
                argname=self.split_arg if split is not None else "",
                size=size,
                axis=axis,
            )

        boxed = self.param(name, boxed_init, local, self.param_dtype, unbox=False)
        return _plain(boxed)


def _linear(
    layer: ParallelMLP | ParallelSelfAttention,
    name: str,
    ranks: int | None,
    kernel_shape: tuple[int, ...],
    kernel_split: int | None,
    bias_shape: tuple[int, ...],
    bias_split: int | None,
    *,
    fan_in_dims: int = 1,
    split_arg: str,
    kernel_init: Initializer | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The params of ``layer``'s linear map ``name`` (a :class:`_Linear` below it); no bias
    where the layer has ``use_bias=False``. Called inside the layer's ``__call__``."""
    return _Linear(
        api=_where(layer),
        kernel_shape=kernel_shape,
        kernel_split=kernel_split,
        fan_in_dims=fan_in_dims,
        bias_shape=bias_shape if layer.use_bias else None,
        bias_split=bias_split,
        axis=roles.axis(layer.axis),
        ranks=ranks,
        kernel_init=layer.kernel_init if kernel_init is None else kernel_init,
        bias_init=layer.bias_init,
        param_dtype=layer.param_dtype,
        split_arg=split_arg,
        name=name,
    )()


def _to_front(x: jax.Array) -> jax.Array:
    """Swap the sequence axis (-2) with axis 0, the one ``parallel.row_parallel`` scatters
    (its own inverse; nothing moves for a ``(tokens, features)`` array)."""
    return jnp.swapaxes(x, 0, -2)


# -------------------------------------------------------------------------------- the MLP
class ParallelMLP(linen.Module):
    """The Megatron MLP block ``activation(x @ W1 + b1) @ W2 + b2``, split over ``axis``.

    Equivalent to the dense block (flax's ``Dense(hidden, name="fc1")``, the activation,
    ``Dense(features, name="fc2")``; torch's ``Linear``, ``GELU()``, ``Linear``) on the whole
    params::

        def mlp(x):
            return activation(x @ fc1.kernel + fc1.bias) @ fc2.kernel + fc2.bias

    Params, declared whole and boxed by ``flax.linen.with_partitioning`` with these partition
    names (``d = x.shape[-1]``; the names of a dense ``Dense(name="fc1")``, ``"fc2"``)::

        fc1/kernel  (d, hidden)         (None, axis)   column-parallel
        fc1/bias    (hidden,)           (axis,)
        fc2/kernel  (hidden, features)  (axis, None)   row-parallel
        fc2/bias    (features,)         (None,)        replicated, added once after the sum

    Called where ``axis`` is bound (inside ``jax.shard_map``; params passed with
    ``in_specs=flax.linen.get_partition_spec(variables)``), each rank computes ``hidden/n``
    hidden units with its slices: it runs :func:`jaxcoll.parallel.mlp` (fc1 column-parallel,
    no communication; fc2 row-parallel). The input is the same on every rank and so is the
    output. Where ``axis`` is not bound (outside ``shard_map``, or ``axis=None``) it is the
    dense block on whole params, with no collective.

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
        hidden: the hidden width; must divide by the size of ``axis``.
        axis: the mesh axis the layer is split over; None for the dense layer everywhere.
        use_bias: give fc1 and fc2 biases (False: nanoGPT's ``bias=False``).
        activation: the nonlinearity; the default is torch's ``nn.GELU()``, the exact GELU
            (:func:`jaxcoll.parallel.gelu`); ``functools.partial(jax.nn.gelu,
            approximate=True)`` is ``nn.GELU(approximate="tanh")``.
        sequence_parallel: under ``shard_map``, the input is this rank's contiguous
            ``1/n`` of the sequence axis (axis -2; the tokens of a ``(tokens, d)`` input) and
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
        Initialise outside ``jax.shard_map`` (whole params). Under ``shard_map`` ``init``
        gives each rank its slice of the same whole initial values, computed whole on every
        rank. Boxed (``nn.Partitioned``) and plain params are both accepted at apply.

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
    axis: str | None = "tensor"
    use_bias: bool = True
    activation: Callable[[jax.Array], jax.Array] = parallel.gelu
    sequence_parallel: bool = False
    kernel_init: Initializer = _default_kernel_init
    bias_init: Initializer = linen.initializers.zeros_init()
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    out_kernel_init: Initializer | None = None

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        axis = roles.axis(self.axis)  # the layout's tensor axis, where one binds
        api = _where(self)
        features = _positive_int(api, "features", self.features)
        hidden = _positive_int(api, "hidden", self.hidden)
        ranks = _bound_size(axis)
        # split here, or (initialising dense under jax.set_mesh) to be placed split
        n = ranks if ranks is not None or not self.is_initializing() else _mesh_size(axis)
        _divides(api, "hidden", hidden, n, axis)
        sp = self.sequence_parallel and ranks is not None
        if jnp.ndim(x) < (2 if sp else 1):
            raise ValueError(
                f"{api}: x has shape {jnp.shape(x)}; it needs a feature axis"
                + (" and a sequence axis (-2) for sequence_parallel=True." if sp else ".")
            )
        d = jnp.shape(x)[-1]
        w1, b1 = _linear(self, "fc1", ranks, (d, hidden), 1, (hidden,), 0, split_arg="hidden")
        w2, b2 = _linear(
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
        if ranks is None:  # dense: the whole block, no collective
            h = self.activation(parallel.column_parallel(x, w1, b1))
            y = h @ w2
            return y if b2 is None else y + b2
        if not sp:
            params = {"w1": w1, "w2": w2}
            if self.use_bias:
                params |= {"b1": b1, "b2": b2}
            return parallel.mlp(params, x, axis, activation=self.activation)
        # sequence parallel: gather the rows, the two halves of parallel.mlp, scatter the rows
        h = self.activation(
            parallel.column_parallel(parallel.sequence_gather(x, axis, axis=-2), w1, b1)
        )
        y = parallel.row_parallel(_to_front(h), w2, axis, b2, scatter=True)
        return _to_front(y)


# -------------------------------------------------------------------------- the attention
class ParallelSelfAttention(linen.Module):
    """Multi-head self-attention with its heads split over ``axis`` (Megatron's attention).

    Equivalent to the dense layer (flax's ``MultiHeadDotProductAttention(num_heads)`` on
    ``(x, x)`` with a causal mask, whose param tree it shares) on the whole params::

        def attention(x):                                  # x: (..., S, d)
            q, k, v = (einsum("...sd,dhk->...shk", x, p.kernel) + p.bias
                       for p in (query, key, value))      # (..., S, H, hd)
            w = softmax(einsum("...qhk,...shk->...hqs", q / sqrt(hd), k)
                        masked to s <= q if causal)        # (..., H, S, S)
            o = einsum("...hqs,...shk->...qhk", dropout(w), v)
            return einsum("...qhk,hko->...qo", o, out.kernel) + out.bias

    Params, declared whole and boxed by ``flax.linen.with_partitioning`` with these partition
    names (``d = x.shape[-1]``, ``H = num_heads``, ``hd = qkv_features / H``,
    ``o = out_features``; a contiguous split of the heads dim gives each rank whole heads)::

        query|key|value/kernel  (d, H, hd)  (None, axis, None)  column-parallel
        query|key|value/bias    (H, hd)     (axis, None)
        out/kernel              (H, hd, o)  (axis, None, None)  row-parallel
        out/bias                (o,)        (None,)             replicated, added once

    Called where ``axis`` is bound (inside ``jax.shard_map``; params passed with
    ``in_specs=flax.linen.get_partition_spec(variables)``), each rank owns ``H/n`` whole heads:
    the q/k/v projections are column-parallel (:func:`jaxcoll.parallel.column_parallel`, no
    communication), the attention of its heads is local, and the output projection is
    row-parallel (:func:`jaxcoll.parallel.row_parallel`), its bias added once after the sum.
    Where ``axis`` is not bound (outside ``shard_map``, or ``axis=None``) it is the dense layer
    on whole params, with no collective.

    Communication per call, forward: ONE all-reduce of the output, ``(..., S, o)``. The
    backward adds its mirror, ONE all-reduce of the input's cotangent (q, k and v share one
    varying copy of the input, so their three cotangents are summed locally first; jax
    inserts the all-reduce under ``shard_map``'s default ``check_vma=True``). With
    ``sequence_parallel=True``: one all-gather of the input's rows and one reduce-scatter of
    the output's, and in the backward one reduce-scatter, one all-gather and, with
    ``use_bias``, an all-reduce of the output bias's gradient ``(o,)``.

    Attributes:
        num_heads: the number of heads H; must divide by the size of ``axis``.
        axis: the mesh axis the heads are split over; None for the dense layer everywhere.
        use_bias: give the four projections biases.
        causal: mask each position's attention to itself and the positions before it.
        dropout_rate: dropout of the attention weights, applied when called with
            ``deterministic=False`` (an rng ``"dropout"`` is then needed). Head h's mask is
            drawn from ``jax.random.fold_in(rng, h)``, so the split layer drops exactly what
            the dense layer drops.
        qkv_features: the width of q, k and v, ``H * hd`` (None: the input width); must
            divide by ``num_heads``.
        out_features: the output width (None: the input width).
        sequence_parallel: under ``shard_map``, the input is this rank's contiguous ``1/n`` of
            the sequence axis (-2) and so is the output. Ignored in dense mode.
        kernel_init: initializer of the four kernels (called on the whole, flat kernel:
            ``(d, H*hd)`` and ``(H*hd, o)``, as flax's ``DenseGeneral`` does).
        bias_init: initializer of the four biases.
        dtype: the computation dtype (None: from the input and params).
        param_dtype: the params' dtype.
        fused_qkv: one kernel for q, k and v, ``qkv/kernel`` of shape ``(d, 3, H, hd)``
            (split over its heads dim, ``(None, None, axis, None)``) and ``qkv/bias``
            ``(3, H, hd)``, instead of three: nanoGPT's and GPT-2's ``c_attn`` as it is,
            reshaped (``c_attn.weight.T.reshape(d, 3, H, hd)`` from torch; its output is
            q, k, v in that order, each head's ``hd`` columns together).
        out_kernel_init: the output projection's own initializer (None: ``kernel_init``),
            e.g. GPT-2's ``normal(0.02 / sqrt(2 * n_layer))`` for ``c_proj``.

    Called as ``module.apply(variables, x, deterministic=True)`` with ``x`` of shape
    ``(..., S, d)``, it returns the output, ``(..., S, o)``.

    Note:
        Initialise outside ``jax.shard_map`` (whole params). Under ``shard_map`` ``init``
        gives each rank its slice of the same whole initial values, computed whole on every
        rank. Boxed (``nn.Partitioned``) and plain params are both accepted at apply.

    Example (2 devices)::

        >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("tensor",))
        >>> attn = ParallelSelfAttention(num_heads=4)
        >>> x = jnp.ones((2, 10, 32))  # (batch, sequence, features)
        >>> variables = attn.init(jax.random.key(0), x)
        >>> specs = flax.linen.get_partition_spec(variables)
        >>> specs["params"]["query"]["kernel"], specs["params"]["out"]["kernel"]
        (P(None, 'tensor', None), P('tensor', None, None))
        >>> split = jax.jit(jax.shard_map(attn.apply, mesh=mesh, in_specs=(specs, P()),
        ...                               out_specs=P()))
        >>> bool(jnp.allclose(split(variables, x), attn.apply(variables, x), atol=1e-5))
        True
    """

    num_heads: int
    axis: str | None = "tensor"
    use_bias: bool = True
    causal: bool = True
    dropout_rate: float = 0.0
    qkv_features: int | None = None
    out_features: int | None = None
    sequence_parallel: bool = False
    kernel_init: Initializer = _default_kernel_init
    bias_init: Initializer = linen.initializers.zeros_init()
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    fused_qkv: bool = False
    out_kernel_init: Initializer | None = None

    @linen.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        axis = roles.axis(self.axis)  # the layout's tensor axis, where one binds
        api = _where(self)
        heads = _positive_int(api, "num_heads", self.num_heads)
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(
                f"{api}: dropout_rate={self.dropout_rate!r} must be in [0, 1): the fraction "
                f"of attention weights dropped."
            )
        if jnp.ndim(x) < 2:
            raise ValueError(
                f"{api}: x has shape {jnp.shape(x)}; it needs a sequence axis and a feature "
                f"axis, (..., sequence, features)."
            )
        d = jnp.shape(x)[-1]
        qkv = d if self.qkv_features is None else self.qkv_features
        qkv = _positive_int(api, "qkv_features", qkv)
        out = d if self.out_features is None else self.out_features
        out = _positive_int(api, "out_features", out)
        if qkv % heads:
            which = "qkv_features" if self.qkv_features is not None else "the input width"
            raise ValueError(
                f"{api}: {which} {qkv} does not split into num_heads={heads} heads. Pick a "
                f"number of heads that divides {qkv}, or pass qkv_features= a multiple of "
                f"{heads}."
            )
        head_dim = qkv // heads
        ranks = _bound_size(axis)
        # split here, or (initialising dense under jax.set_mesh) to be placed split
        n = ranks if ranks is not None or not self.is_initializing() else _mesh_size(axis)
        _divides(api, "num_heads", heads, n, axis)
        sp = self.sequence_parallel and ranks is not None
        q_shape, bias_shape = (d, heads, head_dim), (heads, head_dim)
        if self.fused_qkv:  # one (d, 3, H, hd) kernel: nanoGPT's c_attn, (d, 3d), reshaped
            w, b = _linear(
                self, "qkv", ranks, (d, 3) + bias_shape, 2, (3,) + bias_shape, 1,
                split_arg="num_heads",
            )  # fmt: skip
            qkv_params = [w[:, 0], None if b is None else b[0], w[:, 1]]
            qkv_params += [None if b is None else b[1], w[:, 2], None if b is None else b[2]]
        else:
            qkv_params = [
                p
                for name in ("query", "key", "value")
                for p in _linear(
                    self, name, ranks, q_shape, 1, bias_shape, 0, split_arg="num_heads"
                )
            ]
        wo_bo = _linear(
            self,
            "out",
            ranks,
            (heads, head_dim, out),
            0,
            (out,),
            None,
            fan_in_dims=2,
            split_arg="num_heads",
            kernel_init=self.out_kernel_init,
        )
        promoted = linen.dtypes.promote_dtype(x, *qkv_params, *wo_bo, dtype=self.dtype)
        x, wq, bq, wk, bk, wv, bv, wo, bo = promoted
        local_heads = heads // (ranks or 1)

        if sp:  # this rank's rows of the sequence -> the whole sequence
            x = parallel.sequence_gather(x, axis, axis=-2)
        elif ranks is not None:
            # Megatron's "f", once for q, k and v: the backward sums their three cotangents
            # of x here and then over the ranks in ONE all-reduce, not one per projection.
            x = cast_varying(x, (axis,))

        def project(w: jax.Array, b: jax.Array | None) -> jax.Array:
            y = parallel.column_parallel(x, w.reshape(d, -1), None if b is None else b.reshape(-1))
            return y.reshape(*y.shape[:-1], local_heads, head_dim)

        q, k, v = project(wq, bq), project(wk, bk), project(wv, bv)
        logits = jnp.einsum("...qhk,...shk->...hqs", q / jnp.sqrt(head_dim).astype(q.dtype), k)
        seq = logits.shape[-1]
        if self.causal:
            allowed = jnp.tril(jnp.ones((seq, seq), dtype=bool))
            logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        if self.dropout_rate > 0.0 and not deterministic:
            first = 0 if ranks is None else lax.axis_index(axis) * local_heads
            probs = _dropout_heads(
                probs,
                self.make_rng("dropout"),
                first + jnp.arange(local_heads),
                self.dropout_rate,
            )
        o = jnp.einsum("...hqs,...shk->...qhk", probs, v)
        o = o.reshape(*o.shape[:-2], local_heads * head_dim)
        wo = wo.reshape(local_heads * head_dim, out)
        if ranks is None:  # dense: no collective
            y = o @ wo
            return y if bo is None else y + bo
        if not sp:
            return parallel.row_parallel(o, wo, axis, bo)
        return _to_front(parallel.row_parallel(_to_front(o), wo, axis, bo, scatter=True))


def _dropout_heads(weights: jax.Array, rng: jax.Array, heads: jax.Array, rate: float) -> jax.Array:
    """Dropout of ``weights`` (..., h, S, S) whose head i is global head ``heads[i]``: that
    head's mask is drawn from ``fold_in(rng, heads[i])``, the same in the dense layer and on
    the rank that owns the head."""
    per_head = weights.shape[:-3] + weights.shape[-2:]

    def keep_of(head: jax.Array) -> jax.Array:
        return jax.random.bernoulli(jax.random.fold_in(rng, head), 1.0 - rate, per_head)

    keep = jnp.moveaxis(jax.vmap(keep_of)(heads), 0, -3)
    return jnp.where(keep, weights / (1.0 - rate), jnp.zeros_like(weights))
