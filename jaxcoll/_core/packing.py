"""Flat buffers: several leaves as one, a buffer as ``n`` rows, any dtype as raw bits.

Every algorithm and the data-parallel buckets move data in these shapes; they are written
once here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def pack(leaves: Sequence[jax.Array]) -> jax.Array:
    """Ravel ``leaves`` (one dtype) into one flat buffer, in order."""
    if len(leaves) == 1:
        return jnp.ravel(leaves[0])
    return jnp.concatenate([jnp.ravel(leaf) for leaf in leaves])


def unpack(flat: jax.Array, likes: Sequence[jax.Array]) -> list[jax.Array]:
    """Inverse of :func:`pack`: cut ``flat`` into arrays shaped like ``likes``."""
    out, start = [], 0
    for like in likes:
        size = int(np.prod(like.shape))
        out.append(flat[start : start + size].reshape(like.shape))
        start += size
    return out


def to_rows(x: jax.Array, n: int) -> jax.Array:
    """Ravel ``x`` and zero-pad it to ``(n, m)`` with ``m = ceil(x.size / n)`` (at least 1).

    The rows are contiguous chunks; the padding is discarded by :func:`from_rows`.
    """
    m = max(1, -(-x.size // n))
    flat = jnp.ravel(x)
    if m * n != x.size:
        flat = jnp.concatenate([flat, jnp.zeros((m * n - x.size,), x.dtype)])
    return flat.reshape(n, m)


def from_rows(rows: jax.Array, like: jax.Array) -> jax.Array:
    """Inverse of :func:`to_rows`: drop the padding and restore ``like``'s shape."""
    return jnp.ravel(rows)[: like.size].reshape(like.shape)


def to_bits(x: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """Reinterpret ``x`` as unsigned integers (bit-exact), so OR can merge it with zeros.

    Returns the bits and a function that turns bits back into ``x``'s dtype and shape.
    """
    dtype = x.dtype
    if dtype == jnp.bool_:
        return x.astype(jnp.uint8), lambda b: b.astype(jnp.bool_)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        parts = jnp.stack([jnp.real(x), jnp.imag(x)])
        bits, back = to_bits(parts)
        return bits, lambda b: lax.complex(*back(b))
    if jnp.issubdtype(dtype, jnp.integer):
        return x, lambda b: b
    width = np.dtype(dtype).itemsize
    udt = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[width]
    return lax.bitcast_convert_type(x, udt), lambda b: lax.bitcast_convert_type(b, dtype)


def split_leading(x: jax.Array, dim: int, n: int, tiled: bool) -> jax.Array:
    """Bring the ``n`` slices of ``x`` along ``dim`` to a new leading dimension of size ``n``.

    Untiled: ``x.shape[dim] == n`` and each slice drops that dimension. Tiled: each slice keeps
    it, with ``x.shape[dim] // n`` entries.
    """
    x = jnp.moveaxis(x, dim, 0)
    if tiled:
        x = x.reshape((n, x.shape[0] // n) + x.shape[1:])
    return x


def unsplit_slice(y: jax.Array, dim: int, tiled: bool) -> jax.Array:
    """Inverse of :func:`split_leading` for one slice (leading dimension already removed)."""
    return jnp.moveaxis(y, 0, dim) if tiled else y


def place_gathered(stacked: jax.Array, dim: int, tiled: bool) -> jax.Array:
    """Put the rank dimension of ``stacked`` (``(n, *s)``, rank order) where ``all_gather``
    puts it: a new dimension at ``dim``, or (``tiled``) concatenated along ``dim``."""
    out = jnp.moveaxis(stacked, 0, dim)
    if tiled:
        shape = stacked.shape[1:]
        out = out.reshape(shape[:dim] + (stacked.shape[0] * shape[dim],) + shape[dim + 1 :])
    return out
