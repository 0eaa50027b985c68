"""The one registry of algorithms: names, validation, ``auto``'s choice, per-dtype buffers.

Every algorithm module (:mod:`.native`, :mod:`.ring`, :mod:`.tree`, :mod:`.hierarchical`)
offers the same five functions on one validated leaf: ``all_reduce(x, ax, op, kind)``,
``reduce(x, ax, dst, op, kind)``, ``broadcast(x, ax, src)``, ``all_gather(x, ax, dim,
tiled)`` and ``reduce_scatter(x, ax, op, kind, dim, tiled)``, and a flag ``PACKS``: whether
leaves of one dtype travel as one flat buffer (every ppermute-built algorithm) or as
one collective each (native: XLA's combiner merges them). A new algorithm is one module here
plus one line in :data:`MODULES`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import numpy as np

from .._core.axis import Axis
from .._core.packing import pack, unpack
from . import hierarchical, native, ring, tree
from .auto import choose

MODULES: dict[str, ModuleType] = {
    "native": native,
    "ring": ring,
    "tree": tree,
    "hierarchical": hierarchical,
}
ALGORITHMS = (*MODULES, "auto")
"""Every name ``algorithm=`` accepts."""


def check_algorithm(api: str, algorithm: Any, argname: str = "algorithm") -> str:
    """``algorithm`` (passed as ``argname``) must be one of :data:`ALGORITHMS` (a string)."""
    if not isinstance(algorithm, str):
        raise TypeError(
            f"{api}: {argname} must be a string, one of {', '.join(ALGORITHMS)}; "
            f"got {algorithm!r} of type {type(algorithm).__name__} instead."
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"{api}: {argname}={algorithm!r} is not one of "
            f'{", ".join(ALGORITHMS)}. Pass one of them ("auto" picks from the '
            f"measured table)."
        )
    return algorithm


def nbytes_of(leaves: list[jax.Array]) -> int:
    """Bytes per rank of ``leaves``."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in leaves)


def pick(api: str, op: str, algorithm: str, ax: Axis, nbytes: int) -> ModuleType:
    """The algorithm module for one call: ``algorithm`` itself, or ``auto``'s choice for a
    message of ``nbytes`` bytes per rank (``algorithm`` already checked). An empty message
    takes the native path whatever the algorithm: there is nothing to move."""
    if nbytes == 0:
        return native
    return MODULES[
        resolve(op, algorithm, nbytes, group_size=ax.size, two_level=isinstance(ax.name, tuple))
    ]


def resolve(op: str, algorithm: str, nbytes: int, *, group_size: int, two_level: bool) -> str:
    """The algorithm's name: ``algorithm`` itself, or ``auto``'s choice for ``nbytes`` bytes per
    rank over ``group_size`` ranks (``two_level``: a tuple of mesh axes)."""
    if algorithm != "auto":
        return algorithm
    return choose(op, nbytes, group_size=group_size, two_level=two_level)


def run(
    api: str,
    op: str,
    algorithm: Any,
    leaves: list[jax.Array],
    ax: Axis,
    call: Callable[[ModuleType, jax.Array, int], jax.Array],
    *,
    by_dtype: bool = True,
) -> list[jax.Array]:
    """Run ``call(module, x, i)`` for every leaf, the algorithm chosen per dtype.

    Where the chosen algorithm packs, once per dtype on the leaves packed into one buffer
    (``i``: its first leaf); else per leaf. ``by_dtype=False`` chooses the algorithm per leaf
    and never packs: for ops whose result's shape depends on the leaf's (all_gather,
    reduce_scatter).
    """
    algorithm = check_algorithm(api, algorithm)
    batches: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        batches.setdefault(np.dtype(leaf.dtype) if by_dtype else i, []).append(i)
    out: list[Any] = [None] * len(leaves)
    for idx in batches.values():
        group = [leaves[i] for i in idx]
        mod = pick(api, op, algorithm, ax, nbytes_of(group))
        if not mod.PACKS or len(idx) == 1:
            for i in idx:
                out[i] = call(mod, leaves[i], i)
            continue
        for i, res in zip(idx, unpack(call(mod, pack(group), idx[0]), group), strict=True):
            out[i] = res
    return out
