"""Shared pieces of the algorithms: flattening and padding, ring permutations, sub-axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._ops import ReduceOp
from ..primitives._axis import Axis


def ring_perm(n: int, hop: int = 1) -> list[tuple[int, int]]:
    """Every rank sends to rank ``+hop`` (mod n): one full-cycle ``ppermute``."""
    return [(i, (i + hop) % n) for i in range(n)]


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


def finish_avg(x: jax.Array, op: ReduceOp, n: int) -> jax.Array:
    """AVG folds with ``+``; divide the finished sum by the group size once."""
    if op is ReduceOp.AVG:
        return (x / jnp.asarray(n, x.dtype)).astype(x.dtype)
    return x


def sub_axes(api: str, ax: Axis, algorithm: str) -> tuple[Axis, Axis]:
    """Split a tuple axis into (outer, inner): inner is the last name, outer the rest.

    Ranks are numbered row-major over the tuple, so rank = outer_rank * inner_size + inner_rank.
    """
    if not isinstance(ax.name, tuple):
        raise ValueError(
            f"{api}: algorithm={algorithm!r} needs a 2-D group, a tuple axis_name like "
            f"('node', 'local') (outer, inner), got axis_name={ax.name!r}. Build the mesh with "
            f"two axes, e.g. jax.make_mesh((2, 4), ('node', 'local')), or pick another algorithm."
        )
    # Sub-axis names stay tuples: some lax collectives (pbroadcast) iterate a plain name.
    outer_name, inner_name = ax.name[:-1], ax.name[-1:]
    outer = Axis(outer_name, int(lax.axis_size(outer_name)))
    inner = Axis(inner_name, int(lax.axis_size(inner_name)))
    return outer, inner


def to_bits(x: jax.Array) -> tuple[jax.Array, object]:
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
