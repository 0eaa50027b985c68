"""Quantized communication for FSDP (DeepSpeed ZeRO++'s qwZ and qgZ): params all-gathered and
gradients reduce-scattered in 8 bits with a float32 scale per block of elements.

* **Params** (qwZ; torchtitan's float8 all-gather): each device's slice, per block of
  ``block`` elements, is divided by its block's absolute maximum over the dtype's largest
  value, cast to ``params`` (``float8_e4m3fn``: rounded to 3 mantissa bits; ``int8``: rounded to
  the nearest of +-127), all-gathered with its scales, and multiplied back on every device.
  The fp32 master params are untouched: each step quantizes them afresh, so no error
  accumulates in them. The gradient is the one of the dequantized params, passed to the
  master unchanged (straight through).
* **Gradients** (qgZ): each device's local gradient (divided by n) is cut into the n parts
  the ranks own, each part quantized per block to ``grads``, sent by one all-to-all (each
  rank receives the n quantized copies of its own part), dequantized and summed in float32.
  One quantization per step, rounded to nearest, so the error is one 8-bit rounding of each
  rank's share, not a sum of roundings; it is not fed back (an error buffer would be a whole
  fp32 gradient per device, the memory FSDP exists to save).

Each leaf's rows are padded to whole blocks on their own, so a block never mixes two leaves;
the leaves of a bucket travel in one collective (the payload and the scales one each).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ... import primitives
from ..._core.typing import AxisName
from ..._core.vma import varying_axes
from ..buckets import plan_buckets
from .packing import _columns, _row, _scaled, _unrow

#: The 8-bit dtypes a block can travel in.
DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8")


def _dtype(api: str, name: str, value: Any) -> Any:
    if value is None:
        return None
    try:
        dt = jnp.dtype(value)
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES:
        raise TypeError(
            f"{api}: {name} must be one of jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8 or "
            f"None, got {value!r} instead."
        )
    return dt


@dataclass(frozen=True)
class Quantize:
    """What FSDP sends in 8 bits: ``FSDP(quantize=dp.Quantize(params=jnp.float8_e4m3fn,
    grads=jnp.int8))`` (DeepSpeed ZeRO++'s qwZ and qgZ; see :mod:`jaxcoll.dp.sync.quantized`).

    Attributes:
        params: the dtype the params' slices are all-gathered in (``jnp.float8_e4m3fn``,
            ``jnp.float8_e5m2`` or ``jnp.int8``), with a float32 scale per block; None: as
            the strategy gathers them otherwise (their dtype, or the mixed precision
            policy's ``param_dtype``). Dequantized to that dtype on arrival.
        grads: the dtype the gradients' parts travel in for the reduce-scatter (an
            all-to-all, then a float32 sum); None: a plain reduce-scatter.
        block: elements per scale (a positive int); the bytes sent per element are
            1 + 4 / block (256: 0.254 of float32's).
    """

    params: Any = None
    grads: Any = None
    block: int = 256

    def __post_init__(self) -> None:
        api = "dp.Quantize"
        object.__setattr__(self, "params", _dtype(api, "params", self.params))
        object.__setattr__(self, "grads", _dtype(api, "grads", self.grads))
        b = self.block
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0:
            raise ValueError(f"{api}: block must be a positive int, got {b!r} instead.")


def quantize(rows: jax.Array, dtype: Any, block: int) -> tuple[jax.Array, jax.Array]:
    """``rows`` ``(k, m)`` -> ``(payload (k, m'), scales (k, m' / block))``: each row padded
    with zeros to whole blocks, each block divided by ``max|block| / max(dtype)`` (1 for a
    block of zeros) and cast to ``dtype`` (int8: rounded to the nearest, clipped to +-127)."""
    k, m = rows.shape
    width = -(-m // block) * block
    x = jnp.pad(rows.astype(jnp.float32), ((0, 0), (0, width - m)))
    x = x.reshape(k, width // block, block)
    top = float(127 if jnp.dtype(dtype) == jnp.int8 else jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / top, jnp.ones_like(amax))
    y = x / scale
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.clip(jnp.round(y), -top, top)
    return y.astype(dtype).reshape(k, width), scale.reshape(k, width // block)


def dequantize(payload: jax.Array, scales: jax.Array, m: int, block: int) -> jax.Array:
    """Inverse of :func:`quantize` (up to its rounding): ``(k, m)`` in float32."""
    k, width = payload.shape
    x = payload.astype(jnp.float32).reshape(k, width // block, block) * scales[..., None]
    return x.reshape(k, width)[:, :m]


def _blocks(rows: list[jax.Array], dtype: Any, block: int):
    """Each leaf's rows quantized on their own, then concatenated: the payload, the scales,
    and each leaf's padded width and scale count (to cut them apart again)."""
    parts = [quantize(r, dtype, block) for r in rows]
    payload = jnp.concatenate([p for p, _ in parts], axis=1) if len(parts) > 1 else parts[0][0]
    scales = jnp.concatenate([s for _, s in parts], axis=1) if len(parts) > 1 else parts[0][1]
    return payload, scales, [p for p, _ in parts], [s for _, s in parts]


def _unblocks(payload, scales, widths, counts, sizes, block) -> list[jax.Array]:
    """Every leaf's rows (``sizes[i]`` elements each), dequantized, from the concatenated
    payload and scales."""
    p_parts, s_parts = _columns(payload, widths), _columns(scales, counts)
    return [dequantize(p, s, m, block) for p, s, m in zip(p_parts, s_parts, sizes, strict=True)]


def gather_quantized(
    shards: Sequence[jax.Array],
    dims: Sequence[int],
    axis_name: AxisName,
    *,
    quant: Quantize,
    out_dtypes: Sequence[Any],
    bucket_bytes: float | None,
) -> list[jax.Array]:
    """:func:`~jaxcoll.dp.sync.packing.gather_leaves` with the slices sent in
    ``quant.params`` (two all-gathers per bucket: the payload and the scales), each whole
    leaf dequantized to ``out_dtypes[i]``."""
    n = primitives.world_size(axis_name)
    wholes = [
        jax.ShapeDtypeStruct(_scaled(x.shape, d, n), jnp.float32)
        for x, d in zip(shards, dims, strict=True)
    ]
    out: list[Any] = [None] * len(shards)
    for bucket in plan_buckets(wholes, bucket_bytes, [varying_axes(x) for x in shards]):
        rows = [_row(shards[i], dims[i], 1) for i in bucket]
        payload, scales, ps, ss = _blocks(rows, quant.params, quant.block)
        # Params cross devices here: 8 bits per element and a float32 scale per block.
        payload, scales = primitives.all_gather(
            [payload, scales], axis_name, axis=0, tiled=True, algorithm="native"
        )
        sizes = [r.shape[1] for r in rows]
        for i, part in zip(bucket, _unblocks(payload, scales, ps, ss, sizes, quant.block)):
            out[i] = _unrow(part, dims[i], wholes[i].shape).astype(out_dtypes[i])
    return out


def scatter_quantized(
    grads: Sequence[jax.Array],
    dims: Sequence[int],
    axis_name: AxisName,
    *,
    quant: Quantize,
    bucket_bytes: float | None,
) -> list[jax.Array]:
    """:func:`~jaxcoll.dp.sync.packing.scatter_leaves` with the parts sent in
    ``quant.grads`` (qgZ): per bucket, each rank's n parts quantized, one all-to-all for the
    payload and one for the scales, the n received copies of this rank's part dequantized
    and summed in float32; each slice returned in its gradient's dtype."""
    n = primitives.world_size(axis_name)
    shapes = [jax.ShapeDtypeStruct(g.shape, jnp.float32) for g in grads]
    out: list[Any] = [None] * len(grads)
    for bucket in plan_buckets(shapes, bucket_bytes):
        rows = [_row(grads[i].astype(jnp.float32), dims[i], n) for i in bucket]
        payload, scales, ps, ss = _blocks(rows, quant.grads, quant.block)
        # Gradients cross devices here: each rank receives every rank's quantized copy of
        # its own part (8 bits per element, a float32 scale per block).
        payload, scales = primitives.all_to_all([payload, scales], axis_name, 0, 0, tiled=True)
        sizes = [r.shape[1] for r in rows]
        parts = _unblocks(payload, scales, ps, ss, sizes, quant.block)
        for i, part in zip(bucket, parts, strict=True):
            shape = _scaled(grads[i].shape, dims[i], 1, n)
            summed = jnp.sum(part, axis=0, keepdims=True)
            out[i] = _unrow(summed, dims[i], shape).astype(grads[i].dtype)
    return out
