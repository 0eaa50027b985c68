"""Resolving ``axis_name`` inside shard_map: the group's size, this device's rank."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclass(frozen=True)
class Axis:
    """A bound mesh axis (or tuple of axes) as a collective sees it."""

    name: Any  # what lax takes: a name or a tuple of names
    size: int
    vmapped: bool = False  # bound by jax.vmap(axis_name=...), not by a mesh

    def rank(self) -> jax.Array:
        """This device's position along the axis (row-major over a tuple of names)."""
        return lax.axis_index(self.name)


def _describe(axis_name: Any) -> str:
    if isinstance(axis_name, tuple):
        return " and ".join(repr(a) for a in axis_name)
    return repr(axis_name)


def resolve(api: str, axis_name: Any) -> Axis:
    """Check ``axis_name`` and return its :class:`Axis`, or raise a clear error.

    Raises:
        TypeError: ``axis_name`` is not a hashable name or a tuple of them.
        ValueError: the name is not bound, because the call is outside ``jax.shard_map`` (or the
            mesh has no such axis).
    """
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    if isinstance(axis_name, tuple):
        if not axis_name:
            raise ValueError(f"{api}: axis_name=() names no mesh axis; pass at least one name.")
        if len(set(axis_name)) != len(axis_name):
            raise ValueError(f"{api}: axis_name={axis_name!r} repeats a mesh axis.")
        if len(axis_name) == 1:
            axis_name = axis_name[0]
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for a in names:
        if a is None or not isinstance(a, Hashable):
            raise TypeError(
                f"{api}: axis_name must be a mesh axis name (e.g. 'x') or a tuple of them, got "
                f"{axis_name!r} instead."
            )
    try:
        size = lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{api}: axis_name={axis_name!r} is not bound here. Call it inside jax.shard_map over "
            f"a mesh with axis {_describe(axis_name)}, e.g. jax.shard_map(f, mesh=mesh, "
            f"in_specs=P({_describe(axis_name)}), out_specs=P({_describe(axis_name)}))."
        ) from None
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    return Axis(axis_name, int(size), vmapped=not all(a in manual for a in names))


def bound(api: str, axis_name: Any, arg: str = "axis_name") -> bool:
    """Whether ``axis_name`` is bound here (by an enclosing ``jax.shard_map``, or ``pmap`` /
    ``vmap`` with that ``axis_name``), for functions that run dense where it is not.

    jax 0.10's ``lax.axis_size`` raises ``NameError`` ("unbound axis name: x") for a name
    nothing binds, inside ``jax.jit`` and out, and also under ``jax.set_mesh`` of a mesh with
    that axis (a mesh alone binds no name). A tuple of names is bound when all its names are;
    some bound and some not raises ValueError (naming the argument ``arg``).
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    flags = []
    for name in names:
        try:
            lax.axis_size(name)
        except NameError:
            flags.append(False)
        else:
            flags.append(True)
    if all(flags) or not any(flags):
        return all(flags)
    unbound = [n for n, f in zip(names, flags, strict=True) if not f]
    raise ValueError(
        f"{api}: {arg}={axis_name!r} is bound only in part ({unbound!r} not bound here). "
        f"Call it inside jax.shard_map over a mesh with all of {axis_name!r}, or outside "
        f"any for the dense model."
    )


def is_rank(ax: Axis, ranks: int | Iterable[int]) -> jax.Array:
    """A traced bool: is this device's rank ``ranks`` (an int) or one of ``ranks``?"""
    if isinstance(ranks, (int, np.integer)):
        return ax.rank() == ranks
    mask = np.zeros(ax.size, dtype=bool)
    mask[list(ranks)] = True
    return lax.dynamic_index_in_dim(jnp.asarray(mask), ax.rank(), 0, keepdims=False)


def permute(x: jax.Array, ax: Axis, pairs: Sequence[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute`` over ``ax`` with the (src, dst) ``pairs``; ranks no pair sends to get
    zeros. Under ``jax.vmap`` (whose ppermute wants a full permutation) the pairs are completed
    with the idle ranks; callers mask what those receive."""
    pairs = list(pairs)
    if ax.vmapped and len(pairs) < ax.size:
        idle_src = [r for r in range(ax.size) if r not in {s for s, _ in pairs}]
        idle_dst = [r for r in range(ax.size) if r not in {d for _, d in pairs}]
        extra = list(zip(idle_src, idle_dst))
        got = lax.ppermute(x, ax.name, perm=pairs + extra)
        return jnp.where(is_rank(ax, [d for _, d in extra]), jnp.zeros_like(got), got)
    return lax.ppermute(x, ax.name, perm=pairs)
