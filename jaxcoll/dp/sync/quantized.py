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
  Each rank's share is quantized once, rounded to nearest, and the sum is taken in float32
  and never quantized again (a ring of 8-bit partial sums would round at every hop); the
  rounding is not fed back (an error buffer would be a whole fp32 gradient per device, the
  memory FSDP exists to save).

Each leaf's rows are padded to whole blocks on their own, so a block never mixes two leaves;
the leaves of a bucket travel in one collective (the payload and the scales one each).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ... import primitives
from ..._core.checks import check_dtype
from ..._core.typing import AxisName
from .packing import _columns

#: The 8-bit dtypes a block can travel in.
DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8")


def _dtype(name: str, value: Any) -> Any:
    return check_dtype(
        "dp.Quantize",
        name,
        value,
        lambda dt: dt.name in DTYPES,
        "one of jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8",
    )


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
        object.__setattr__(self, "params", _dtype("params", self.params))
        object.__setattr__(self, "grads", _dtype("grads", self.grads))
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


class Blocks:
    """The :class:`~jaxcoll.dp.sync.packing.Codec` that sends rows in ``dtype``, a float32
    scale per ``block`` elements: each leaf's rows quantized on their own (a block never
    mixes two leaves), the payloads and the scales of a bucket concatenated, one collective
    each."""

    def __init__(self, dtype: Any, block: int) -> None:
        self.dtype, self.block = dtype, block

    def _encode(self, rows: list[jax.Array]):
        parts = [quantize(r, self.dtype, self.block) for r in rows]
        return [jnp.concatenate([p[k] for p in parts], axis=1) for k in (0, 1)], parts

    def _decode(self, bufs: list[jax.Array], parts, rows: list[jax.Array]) -> list[jax.Array]:
        payloads = _columns(bufs[0], [p for p, _ in parts])
        scales = _columns(bufs[1], [s for _, s in parts])
        return [
            dequantize(p, s, r.shape[1], self.block)
            for p, s, r in zip(payloads, scales, rows, strict=True)
        ]

    def gather(self, rows: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
        bufs, parts = self._encode(rows)
        # 8 bits per element and a float32 scale per block: two all-gathers.
        bufs = primitives.all_gather(bufs, axis_name, dim=0, tiled=True, algorithm="native")
        return self._decode(bufs, parts, rows)

    def scatter(self, rows: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
        bufs, parts = self._encode([r.astype(jnp.float32) for r in rows])
        # Each rank receives every rank's quantized copy of its own part: two all-to-alls;
        # the copies dequantized and summed in float32.
        bufs = primitives.all_to_all(bufs, axis_name, 0, 0, tiled=True)
        wholes = self._decode(bufs, parts, rows)
        return [jnp.sum(w, axis=0, keepdims=True) for w in wholes]


def quantized_mean(q: Quantize, axis: str, count: int) -> Any:
    """Per rank (``jax.shard_map``): ``(params, local) -> params - mean(params - local)``
    over the ``count`` replicas of ``axis``, the mean sent in ``q.grads``
    (:meth:`jaxcoll.dp.sync.DiLoCo.replica_mean`). ``local``'s leaves are this replica's
    (1, ...) blocks."""
    dtype, block = q.grads, q.block

    def body(params: list, local: list) -> list:
        deltas = [(p - x[0]).astype(jnp.float32).reshape(-1) for p, x in zip(params, local)]
        padded = [jnp.pad(d, (0, -d.size % block)) for d in deltas]
        flat = jnp.concatenate(padded)
        rows = jnp.pad(flat, (0, -flat.size % (count * block))).reshape(count, -1)
        width = rows.shape[1]
        # Pseudo-gradients cross replicas here, in 8 bits: each replica receives every
        # replica's copy of its row (one all-to-all of the payloads, one of the scales) ...
        sent = primitives.all_to_all(list(quantize(rows, dtype, block)), axis, 0, 0, tiled=True)
        part = jnp.mean(dequantize(sent[0], sent[1], width, block), axis=0, keepdims=True)
        # ... and their mean, quantized again, is all-gathered (two all-gathers).
        got = primitives.all_gather(list(quantize(part, dtype, block)), axis, dim=0, tiled=True)
        mean = dequantize(got[0], got[1], width, block).reshape(-1)
        out, at = [], 0
        for p, d, pad in zip(params, deltas, padded, strict=True):
            out.append((p - mean[at : at + d.size].reshape(p.shape)).astype(p.dtype))
            at += pad.size
        return out

    return body
