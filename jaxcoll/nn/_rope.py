"""Rotary position embedding (RoPE), the split-half form Llama's and GPT-NeoX's code use."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """``x`` ``(..., S, heads, head_dim)`` rotated by the angles of ``positions`` ``(..., S)``.

    Equivalent to (``half = head_dim // 2``, each head's dims ``i`` and ``i + half`` a pair)::

        inv_freq = theta ** (-arange(half) / half)
        angle = positions[..., None] * inv_freq          # (..., S, half), one per pair
        x1, x2 = x[..., :half], x[..., half:]
        return concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)   # over the heads

    The angles are computed in float32 and the result is cast back to ``x``'s dtype.
    ``positions`` broadcasts against ``x``'s leading dims (a ``(S,)`` vector serves a batch).
    """
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # (..., S, half)
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]  # one per head
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
