"""``algorithm="native"``: the lax collectives (HLO all-reduce etc.; NCCL on GPU).

The algorithm interface over :mod:`jaxcoll._core.lowering`, so that the registry treats every
algorithm alike. Results equal on every rank are typed invariant.
"""

from __future__ import annotations

import jax

from .._core import lowering
from .._core.axis import Axis
from .._core.ops import ReduceOp

PACKS = False  # one collective per leaf: XLA combines them itself


def all_reduce(x: jax.Array, ax: Axis, op: ReduceOp, kind: str) -> jax.Array:
    return lowering.all_reduce(x, ax, op, kind)


def reduce(x: jax.Array, ax: Axis, dst: int, op: ReduceOp, kind: str) -> jax.Array:
    return lowering.reduce(x, ax, dst, op, kind)


def broadcast(x: jax.Array, ax: Axis, src: int) -> jax.Array:
    return lowering.broadcast(x, ax, src)


def all_gather(x: jax.Array, ax: Axis, dim: int, tiled: bool) -> jax.Array:
    return lowering.all_gather(x, ax, dim, tiled)


def reduce_scatter(
    x: jax.Array, ax: Axis, op: ReduceOp, kind: str, dim: int, tiled: bool
) -> jax.Array:
    return lowering.reduce_scatter(x, ax, op, kind, dim, tiled)
