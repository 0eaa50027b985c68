"""What jaxcoll.nn's layers share: their params, declared whole and boxed with their split.

Each layer declares its params whole (``module.init`` outside ``jax.shard_map`` gives the
dense shapes) and boxed with ``flax.linen.with_partitioning``, so
``flax.linen.get_partition_spec(variables)`` says how to split them over the tensor axis
(:mod:`jaxcoll.parallel.tensor`'s convention too). Called where that axis is bound (inside
``jax.shard_map``), a layer is handed this device's slices and computes through
:mod:`jaxcoll.parallel`'s ``column_parallel`` / ``row_parallel`` / ``mlp`` (one all-reduce
per layer); called where it is not, the same functions are the dense layer on whole params,
with no collective. One model definition serves the single-device reference and the
tensor-parallel run.

The boxes are ``Split``, flax's ``nn.Partitioned`` that also names the layer's argument
its split dimension is (``hidden``, ``num_heads``): ``dp.Trainer.init`` then reports a split
the tensor axis does not divide in the layer's words, as the layer does when it is
initialised under ``jax.set_mesh`` with that axis, before JAX would fail to place the params.
"""

from __future__ import annotations

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

default_kernel_init = linen.initializers.lecun_normal()


# ------------------------------------------------------------------------------ the helpers
def bound_size(axis_name: str | None) -> int | None:
    """The size of mesh axis ``axis_name`` where it is bound (tensor-parallel mode), else None
    (dense mode: ``axis_name=None``, or a name no enclosing ``jax.shard_map`` binds)."""
    if axis_name is None or not parallel.is_bound(axis_name):
        return None
    return int(lax.axis_size(axis_name))


def where(module: linen.Module) -> str:
    """The module's class and, below the root, its path: ``ParallelMLP 'block0/mlp'``."""
    path = "/".join(str(p) for p in module.path)
    return f"{type(module).__name__} {path!r}" if path else type(module).__name__


def positive_int(api: str, argname: str, value: Any) -> int:
    value = check_static_int(api, argname, value)
    if value <= 0:
        raise ValueError(f"{api}: {argname}={value} must be a positive int.")
    return value


_FIX = {  # what to do when the layer's argument does not divide by n
    "hidden": "Pick a hidden width divisible by {n}, or split over an axis whose size divides "
    "{value}.",
    "num_heads": "Each rank owns whole heads: pick a number of heads divisible by {n}, or split "
    "over an axis whose size divides {value}.",
    "num_kv_heads": "Each rank owns whole key/value heads: pick num_kv_heads divisible by {n}; "
    "or, where {n} is a multiple of num_kv_heads, initialise the layer where its tensor "
    "degree is known, under jax.set_mesh(mesh) (or, not placing the params, under "
    "jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(({n},), ({axis!r},)))) with "
    "this axis: it then declares K and V whole (each rank using the key/value head its query "
    "heads share).",
    "num_experts": "Each rank owns whole experts: pick a number of experts divisible by {n}, or "
    "an expert degree that divides {value}.",
}


def _indivisible(where: str, argname: str, value: int, n: int, axis: str | None) -> str:
    fix = _FIX[argname].format(n=n, value=value, axis=axis)
    return (
        f"{where}: {argname}={value} is not divisible by the {n} ranks of mesh axis {axis!r}, "
        f"over which it is split. {fix}"
    )


def divides(where: str, argname: str, value: int, n: int | None, axis: str | None) -> None:
    if n is not None and value % n:
        raise ValueError(_indivisible(where, argname, value, n, axis))


def mesh_size(axis: str | None) -> int | None:
    """The size of ``axis`` in the mesh set by ``jax.set_mesh`` (None if none has it): params
    initialised under it are then placed split over it (``out_shardings`` from their boxes),
    where JAX's own error would name neither the layer nor its argument."""
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None or mesh.empty or axis not in mesh.axis_names:
        return None
    return int(dict(mesh.shape)[axis])


def split_ranks(
    layer: linen.Module, api: str, argname: str, value: int, axis: str | None
) -> int | None:
    """The number of ranks ``layer`` is split over where ``axis`` is bound (None: dense),
    checked to divide ``value`` (its argument ``argname``), there or, when it is initialised
    dense under ``jax.set_mesh``, over the mesh's ``axis`` that will place it."""
    ranks = bound_size(axis)
    n = ranks if ranks is not None or not layer.is_initializing() else mesh_size(axis)
    divides(api, argname, value, n, axis)
    return ranks


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
        # axis None: split over whichever axis its role names (an MoE's experts)
        if not self.argname or size != self.size or len(axes) != 1:
            return None
        if self.axis is not None and tuple(axes) != (self.axis,):
            return None
        return _indivisible(self.layer, self.argname, self.size, n, axes[0])


def _plain(value: Any) -> jax.Array:
    """A param's array without its box, and without flax's sharding constraint (these layers
    communicate themselves; inside shard_map the tensor axis is manual)."""
    if isinstance(value, meta.Partitioned):
        return value.unbox(apply_constraint=False)
    return meta.unbox(value)


class _Linear(linen.Module):
    """Declares (does not apply) the kernel and bias of one linear map, split over
    ``axis_name``.

    ``kernel_shape`` and ``bias_shape`` are the whole (dense) shapes; the kernel's first
    ``fan_in_dims`` dims are its inputs (it is initialised flat, as ``flax.linen.DenseGeneral``
    does). ``kernel_split`` / ``bias_split`` is the dim split over ``axis_name`` (None:
    replicated).
    With ``ranks`` set, the params declared are this rank's slices, and their initial values
    are this rank's slice of the whole initial value.
    """

    api: str
    kernel_shape: tuple[int, ...]
    kernel_split: int | None
    fan_in_dims: int
    bias_shape: tuple[int, ...] | None
    bias_split: int | None
    axis_name: str | None
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
        axis = self.axis_name

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


def linear(
    layer: Any,  # a layer of this package: its axis_name, use_bias, inits and param_dtype
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
        api=where(layer),
        kernel_shape=kernel_shape,
        kernel_split=kernel_split,
        fan_in_dims=fan_in_dims,
        bias_shape=bias_shape if layer.use_bias else None,
        bias_split=bias_split,
        axis_name=roles.axis(layer.axis_name),
        ranks=ranks,
        kernel_init=layer.kernel_init if kernel_init is None else kernel_init,
        bias_init=layer.bias_init,
        param_dtype=layer.param_dtype,
        split_arg=split_arg,
        name=name,
    )()
