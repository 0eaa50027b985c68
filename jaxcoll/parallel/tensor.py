"""Tensor parallelism: a Megatron-style MLP block split over a ``model`` mesh axis.

The first linear layer is split by columns (each rank computes a slice of the hidden units,
no communication), the second by rows (each rank's partial product is summed by ONE
all_reduce); with ``sequence_parallel=True`` the activations stay split over the batch
dimension and the pair becomes all_gather before and reduce_scatter after (the same bytes,
half the activation memory between blocks).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from .. import primitives
from .._core import roles
from .._core.typing import AxisName, PyTree


def column_parallel(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """``x @ w + b`` with ``w`` (and ``b``) this rank's column slice: no communication.

    Equivalent to slice r of the dense ``x @ W + B`` along the last axis, for ``w = W[:,
    r*k:(r+1)*k]``. ``x`` is the same on every rank of the model axis; under ``jax.grad`` its
    cotangent is summed over the ranks by jax itself (the transpose of using an invariant
    value on every rank: Megatron's "f" operator).
    """
    y = x @ w
    return y if b is None else y + b


def row_parallel(
    h: jax.Array,
    w: jax.Array,
    axis_name: AxisName,
    b: jax.Array | None = None,
    *,
    scatter: bool = False,
) -> jax.Array:
    """``h @ W + b`` where ``h`` and ``w`` are this rank's slices along the contracted axis.

    ``w`` may contract several axes: its all but last axes with ``h``'s last ones
    (``jnp.tensordot(h, w, axes=w.ndim - 1)``; an attention output ``(..., S, h, hd)`` by a
    kernel ``(h, hd, d)``), so no kernel needs a reshape. Each rank's partial product is
    summed over ``axis_name`` by one :func:`~jaxcoll.primitives.all_reduce` (Megatron's
    "g"), or with ``scatter=True`` by one :func:`~jaxcoll.primitives.reduce_scatter` of the
    leading (batch) axis, so each rank keeps its 1/n of the rows (sequence parallelism). The
    bias is added once, after the reduction.
    """
    axis_name = roles.axis(axis_name)
    partial = h @ w if jnp.ndim(w) == 2 else jnp.tensordot(h, w, axes=jnp.ndim(w) - 1)
    if scatter:
        y = primitives.reduce_scatter(partial, axis_name, scatter_dimension=0, tiled=True)
    else:
        y = primitives.all_reduce(partial, axis_name)
    return y if b is None else y + b


def sequence_gather(x: jax.Array, axis_name: AxisName, *, axis: int = 0) -> jax.Array:
    """Sequence parallelism's all-gather: every rank's rows of ``x`` along ``axis``, in rank
    order, for this rank's weight slices (Megatron's "g" before a column-parallel layer).

    Equivalent to ``primitives.all_gather(x, axis_name, axis=axis, tiled=True)``, but typed
    *varying*: the gathered rows only meet this rank's weight slices, so nothing needs them
    invariant, and ``jax.grad`` transposes the gather into one reduce-scatter of the rows'
    cotangents. (Typed invariant, as ``primitives.all_gather`` types it, the backward would
    all-reduce the whole cotangent, twice the bytes, then slice it.) Lowering: one
    ``lax.all_gather`` (HLO all-gather).
    """
    return lax.all_gather(x, roles.axis(axis_name), axis=axis % jnp.ndim(x), tiled=True)


def gelu(x: jax.Array) -> jax.Array:
    """torch's ``nn.GELU()``: the exact GELU, ``x * Phi(x)`` (``jax.nn.gelu`` defaults to the
    tanh approximation, torch's ``nn.GELU(approximate="tanh")``)."""
    return jax.nn.gelu(x, approximate=False)


def mlp(
    params: PyTree,
    x: jax.Array,
    axis_name: AxisName,
    *,
    activation: Callable[[jax.Array], jax.Array] = gelu,
    sequence_parallel: bool = False,
) -> jax.Array:
    """A Megatron MLP block ``activation(x @ W1 + b1) @ W2 + b2`` over ``axis_name``.

    ``params``: ``{"w1": (d, f/n), "b1": (f/n,), "w2": (f/n, d), "b2": (d,)}``, this rank's
    slices (``w1``/``b1`` by columns, ``w2`` by rows; ``b2`` whole); ``b1`` and ``b2`` may be
    left out (a block without biases: ``nn.Linear(..., bias=False)``, nanoGPT's default).
    Equivalent to the dense block on the whole ``W1, b1, W2, b2``. The default activation is
    torch's ``nn.GELU()``, the exact GELU (:func:`gelu`); pass
    ``functools.partial(jax.nn.gelu, approximate=True)`` for ``nn.GELU(approximate="tanh")``.
    Communication: one all_reduce of the output ``(tokens, d)``; with ``sequence_parallel``
    (``x`` this rank's ``tokens/n`` rows) one all_gather of the input and one reduce_scatter
    of the output, and the result is again this rank's rows.

    Example (4 devices): see ``examples/07_tensor_parallel.py``.
    """
    extra = sorted(set(params) - {"w1", "b1", "w2", "b2"})
    missing = sorted({"w1", "w2"} - set(params))
    if missing or extra:
        raise ValueError(
            f"parallel.mlp: params must hold 'w1' and 'w2' (and optionally 'b1', 'b2'); "
            f"missing {missing}, unknown {extra}. Build them with parallel.shard_mlp."
        )
    if sequence_parallel:
        x = sequence_gather(x, axis_name)
    h = activation(column_parallel(x, params["w1"], params.get("b1")))
    return row_parallel(h, params["w2"], axis_name, params.get("b2"), scatter=sequence_parallel)


def shard_mlp(params: PyTree, n: int) -> PyTree:
    """Split dense MLP params ``{"w1": (d, f), "b1": (f,), "w2": (f, d), "b2": (d,)}`` (the
    biases optional) into the stacked per-rank slices ``mlp`` takes (leading axis n: shard it
    over the model axis; ``b2`` is replicated). ``f`` must divide by n."""
    f = params["w1"].shape[1]
    if f % n:
        raise ValueError(
            f"shard_mlp: the hidden width {f} does not split over {n} ranks; "
            f"pick a hidden width divisible by {n}."
        )
    k = f // n
    out = {
        "w1": jnp.stack([params["w1"][:, r * k : (r + 1) * k] for r in range(n)]),
        "w2": params["w2"].reshape(n, k, -1),
    }
    if "b1" in params:
        out["b1"] = params["b1"].reshape(n, k)
    if "b2" in params:
        out["b2"] = params["b2"]
    return out
