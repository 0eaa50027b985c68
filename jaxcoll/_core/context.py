"""The load-balanced sequence order of context parallelism: the sequence cut into ``2n``
equal chunks, rank ``r`` of the context axis holding chunks ``r`` and ``2n-1-r`` (in that
order), so under a causal mask every rank has as much attention to compute (torchtitan's and
Megatron's order). ``jaxcoll.parallel`` attends over it; ``jaxcoll.dp`` splits a batch into
it; both read it here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def context_order(length: int, n: int) -> np.ndarray:
    """The global positions of the sequence in the load-balanced order: the ``2n`` chunks
    of ``length / 2n`` in the order ``0, 2n-1, 1, 2n-2, ...`` (rank ``r``'s part of a
    contiguous split over ``n`` is chunks ``r`` and ``2n-1-r``)."""
    if length % (2 * n):
        raise ValueError(
            f"parallel.context_order: a sequence of {length} does not split into {2 * n} "
            f"equal chunks (2 per rank of {n}); pick a length divisible by {2 * n}."
        )
    c = length // (2 * n)
    chunks = [j for r in range(n) for j in (r, 2 * n - 1 - r)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def positions(rank: jax.Array | int, n: int, c: int) -> jax.Array:
    """The global positions of rank ``rank``'s two chunks of ``c`` tokens."""
    i = jnp.arange(c)
    return jnp.concatenate([rank * c + i, (2 * n - 1 - rank) * c + i])


def local_part(x: jax.Array, axis_name: str, n: int, dim: int = 1) -> jax.Array:
    """This rank's part of ``x``, whole along dim ``dim`` on every rank of ``axis_name``
    (inside ``shard_map``): its two chunks, in order, along that dim."""
    length = x.shape[dim]
    if length % (2 * n):
        raise ValueError(
            f"context parallel over {n} ranks: a sequence of {length} does not split into "
            f"{2 * n} equal chunks (2 per rank); pick a length divisible by {2 * n}."
        )
    c = length // (2 * n)
    r = lax.axis_index(axis_name)
    first = lax.dynamic_slice_in_dim(x, r * c, c, axis=dim)
    second = lax.dynamic_slice_in_dim(x, (2 * n - 1 - r) * c, c, axis=dim)
    return jnp.concatenate([first, second], axis=dim)
