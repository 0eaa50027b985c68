"""Tensor parallelism: Megatron's column- and row-parallel maps and its MLP block.

One convention for params, the one :mod:`jaxcoll.nn`'s layers follow: a param is declared
whole, with a partition spec saying which of its dims is split over the tensor axis (for this
module's MLP block, :func:`mlp_specs`). Inside ``jax.shard_map`` (params passed with those
specs as ``in_specs``, or placed by a ``dp.Trainer``) each function takes this device's slice
of each param, as it is handed in; where the tensor axis is not bound (outside
``shard_map``, a mesh without it, ``axis_name=None``) the same call is the dense map on the
whole params, with no collective.

The first linear map is split by columns (each device computes a slice of the hidden units,
no communication), the second by rows (each device's partial product is summed by ONE
all_reduce); with ``sequence_parallel=True`` the activations stay split over the sequence
dim and the pair becomes all_gather before and reduce_scatter after (the same bytes, half
the activation memory between blocks).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .. import primitives
from .._core.roles import Role
from .._core.typing import AxisName, PyTree
from .._core.vma import axis_names, varying_axes
from .axes import bound_axis

_MLP_KEYS = ("w1", "b1", "w2", "b2")


def column_parallel(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """``x @ w + b`` with ``w`` (and ``b``) this device's column slice: no communication.

    Equivalent to this device's slice of the dense ``x @ W + B`` along ``W``'s split output
    dim, for ``w`` its slice of ``W``. ``w`` may have several output dims: ``x``'s last dim is
    contracted with ``w``'s first (``jnp.tensordot(x, w, axes=1)``; a projection to heads by
    a kernel ``(d, H, hd)``), so no kernel needs a reshape. ``x`` is the same on every device
    of the tensor axis; under ``jax.grad`` its cotangent is summed over them by jax itself
    (the transpose of using an invariant value on every device: Megatron's "f" operator).
    Where no tensor axis is bound, ``w`` is the whole kernel and this is the dense map.
    """
    y = x @ w if jnp.ndim(w) == 2 else jnp.tensordot(x, w, axes=1)
    return y if b is None else y + b


def row_parallel(
    h: jax.Array,
    w: jax.Array,
    axis_name: AxisName = Role.TENSOR,
    b: jax.Array | None = None,
    *,
    scatter: bool = False,
    dim: int = 0,
) -> jax.Array:
    """``h @ W + b`` where ``h`` and ``w`` are this device's slices along the contracted dims.

    ``w`` may contract several dims: its all but last dims with ``h``'s last ones
    (``jnp.tensordot(h, w, axes=w.ndim - 1)``; an attention output ``(..., S, h, hd)`` by a
    kernel ``(h, hd, d)``), so no kernel needs a reshape. Each device's partial product is
    summed over ``axis_name`` by one :func:`~jaxcoll.primitives.all_reduce` (Megatron's
    "g"), or with ``scatter=True`` by one :func:`~jaxcoll.primitives.reduce_scatter` of the
    output's dim ``dim``, so each device keeps its contiguous 1/n of it (sequence
    parallelism). The bias ``b`` (whole: replicated) is added once, after the reduction.
    Where ``axis_name`` is not bound, ``h`` and ``w`` are whole and this is the dense map
    ``h @ W + b``, with no collective (``scatter`` does nothing).

    Args:
        h: this device's slice of the input, its contracted dims last.
        w: this device's slice of the kernel, its contracted dims first.
        axis_name: the tensor axis (a role: a ``dp.Trainer``'s layout gives it).
        b: the bias, whole, or None.
        scatter: reduce-scatter the sum along ``dim`` instead of all-reducing it.
        dim: the output's dim ``scatter`` splits (the sequence dim).

    Returns:
        ``h @ W + b``, whole, or with ``scatter`` this device's part of it along ``dim``.
    """
    axis = bound_axis(axis_name, "parallel.row_parallel")
    y = h @ w if jnp.ndim(w) == 2 else jnp.tensordot(h, w, axes=jnp.ndim(w) - 1)
    if axis is not None:
        _check_split(y, axis)
    if axis is not None and scatter:  # the scattered dim to the front, and back
        dim = dim % jnp.ndim(y)
        y = jnp.swapaxes(y, 0, dim)
        y = jnp.swapaxes(primitives.reduce_scatter(y, axis, tiled=True), 0, dim)
    elif axis is not None:
        y = primitives.all_reduce(y, axis)
    return y if b is None else y + b  # (no axis bound: the dense map, no collective)


def _check_split(y: jax.Array, axis: AxisName) -> None:
    """Raise if the partial products ``y`` are the same on every device of ``axis``: ``h``
    and ``w`` are whole there, not this device's slices, and the sum would count them once
    per device (a loss off by the axis size, silently)."""
    found = varying_axes(y)
    if found is None:  # types not tracked (check_vma off): nothing to read
        return
    missing = [a for a in axis_names(axis) if a not in found]
    if missing:
        raise ValueError(
            f"parallel.row_parallel: its inputs h and w are the same on every device of "
            f"{missing[0]!r} (the kernel is whole there, not this device's slice), so summing "
            f"the products over {missing[0]!r} would count them once per device. Split the "
            f"kernels over the tensor axis: give them model specs (logical names in the "
            f"model's sharding metadata, partition rules or specs= to Trainer.init; "
            f"jaxcoll.nn's layers declare theirs), or call a plain matmul where nothing is "
            f"split."
        )


def sequence_gather(x: jax.Array, axis_name: AxisName = Role.TENSOR, *, dim: int = 0) -> jax.Array:
    """Sequence parallelism's all-gather: every device's rows of ``x`` along dim ``dim``, in
    device order, for this device's weight slices (Megatron's "g" before a column-parallel
    map).

    Equivalent to ``primitives.all_gather(x, axis_name, dim=dim, tiled=True)``, but typed
    *varying*: the gathered rows only meet this device's weight slices, so nothing needs
    them invariant, and ``jax.grad`` transposes the gather into one reduce-scatter of the
    rows' cotangents. (Typed invariant, as ``primitives.all_gather`` types it, the backward
    would all-reduce the whole cotangent, twice the bytes, then slice it.) Lowering: one
    ``lax.all_gather`` (HLO all-gather). Where ``axis_name`` is not bound, ``x`` itself.
    """
    axis = bound_axis(axis_name, "parallel.sequence_gather")
    if axis is None:
        return x
    return lax.all_gather(x, axis, axis=dim % jnp.ndim(x), tiled=True)


def gelu(x: jax.Array) -> jax.Array:
    """torch's ``nn.GELU()``: the exact GELU, ``x * Phi(x)`` (``jax.nn.gelu`` defaults to the
    tanh approximation, torch's ``nn.GELU(approximate="tanh")``)."""
    return jax.nn.gelu(x, approximate=False)


def mlp(
    params: PyTree,
    x: jax.Array,
    axis_name: AxisName = Role.TENSOR,
    *,
    activation: Callable[[jax.Array], jax.Array] = gelu,
    sequence_parallel: bool = False,
    dim: int = 0,
) -> jax.Array:
    """A Megatron MLP block ``activation(x @ W1 + b1) @ W2 + b2`` over ``axis_name``.

    ``params``: ``{"w1": (d, f), "b1": (f,), "w2": (f, d), "b2": (d,)}``, declared whole and
    split as :func:`mlp_specs` says (``w1``/``b1`` by columns, ``w2`` by rows; ``b2``
    replicated); inside ``jax.shard_map`` each device is handed its slices, ``(d, f/n)``,
    ``(f/n,)``, ``(f/n, d)`` and ``(d,)``. ``b1`` and ``b2`` may be left out (a block without
    biases: ``nn.Linear(..., bias=False)``, nanoGPT's default). Equivalent to the dense block
    on the whole ``W1, b1, W2, b2``, which it is where ``axis_name`` is not bound. The default
    activation is torch's ``nn.GELU()``, the exact GELU (:func:`gelu`); pass
    ``functools.partial(jax.nn.gelu, approximate=True)`` for ``nn.GELU(approximate="tanh")``.
    Communication: one all_reduce of the output ``(tokens, d)``; with ``sequence_parallel``
    (``x`` this device's contiguous ``1/n`` of dim ``dim``, the tokens) one all_gather of the
    input and one reduce_scatter of the output, and the result is again this device's rows.
    :class:`jaxcoll.nn.ParallelMLP` is this block as a flax layer.

    Example (4 devices): see ``examples/07_tensor_parallel.py``.
    """
    _check_mlp_params("parallel.mlp", params)
    axis = bound_axis(axis_name, "parallel.mlp")
    sp = sequence_parallel and axis is not None
    if sp:
        x = sequence_gather(x, axis, dim=dim)
    h = activation(column_parallel(x, params["w1"], params.get("b1")))
    return row_parallel(h, params["w2"], axis, params.get("b2"), scatter=sp, dim=dim)


def mlp_specs(params: PyTree, axis_name: AxisName = Role.TENSOR) -> PyTree:
    """The partition specs of :func:`mlp`'s whole params over ``axis_name``, for the keys of
    ``params`` (``b1``, ``b2`` optional)::

        w1  (d, f)  P(None, axis_name)   column-parallel
        b1  (f,)    P(axis_name)
        w2  (f, d)  P(axis_name, None)   row-parallel
        b2  (d,)    P()                  replicated, added once after the sum

    Pass them as ``jax.shard_map``'s ``in_specs`` (and ``out_specs`` of the gradients), or
    place the params with them (``NamedSharding(mesh, spec)``); with a logical axis
    (``"mlp"``) they are a ``dp.Trainer``'s ``specs=``. :class:`jaxcoll.nn.ParallelMLP`'s
    boxes say the same. The hidden width ``f`` must divide by the size of the axis.
    """
    _check_mlp_params("parallel.mlp_specs", params)
    axis = axis_name.value if isinstance(axis_name, Role) else axis_name
    specs = {"w1": P(None, axis), "b1": P(axis), "w2": P(axis, None), "b2": P()}
    return {k: specs[k] for k in params}


def _check_mlp_params(api: str, params: PyTree) -> None:
    extra = sorted(set(params) - set(_MLP_KEYS))
    missing = sorted({"w1", "w2"} - set(params))
    if missing or extra:
        raise ValueError(
            f"{api}: params must hold 'w1' and 'w2' (and optionally 'b1', 'b2'); "
            f"missing {missing}, unknown {extra}. Pass the dense block's params, "
            f'{{"w1": (d, f), "b1": (f,), "w2": (f, d), "b2": (d,)}}.'
        )
