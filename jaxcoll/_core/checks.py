"""Argument checkers shared by every public op. Messages read: op, argument, value, fix."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_static_int(api: str, argname: str, value: Any) -> int:
    """A rank, offset or dimension must be a plain Python int known at trace time."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{api}: {argname} must be a static Python int known at trace time, got a traced "
            f"value {value!r} instead. Pass a constant (mark it static under jax.jit)."
        )
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{api}: {argname} must be an int, got {value!r} of type "
            f"{type(value).__name__} instead."
        )
    return operator.index(value)


def check_count(api: str, argname: str, value: Any, low: int, what: str) -> int:
    """A count (steps, checks, iterations) must be an int of at least ``low``; ``what`` says
    what it counts in the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{api}: {argname} must be an int ({what}), got {value!r} of type "
            f"{type(value).__name__} instead."
        )
    if value < low:
        raise ValueError(f"{api}: {argname}={value!r} must be at least {low} ({what}).")
    return int(value)


def check_optional(api: str, argname: str, value: Any, cls: Any, what: str) -> None:
    """``value`` must be an instance of ``cls`` (spelled ``what`` in the message) or None."""
    if value is not None:
        check_instance(api, argname, value, cls, f"{what} or None")


def check_instance(api: str, argname: str, value: Any, cls: Any, what: str) -> None:
    """``value`` must be an instance of ``cls`` (a type or a tuple of types), spelled
    ``what`` in the message."""
    if not isinstance(value, cls):
        raise TypeError(
            f"{api}: {argname} must be {what}, got {value!r} of type "
            f"{type(value).__name__} instead."
        )


def check_dtype(api: str, argname: str, value: Any, allowed: Any, what: str) -> Any:
    """``value`` as a NumPy dtype that ``allowed(dtype)`` accepts (spelled ``what`` in the
    message), or None for None."""
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not allowed(dtype):
        raise TypeError(f"{api}: {argname} must be {what}, or None, got {value!r} instead.")
    return dtype


def is_list(value: Any, n: int | None = None) -> bool:
    """Whether ``value`` is a list, tuple or array (a string is not), of ``n`` entries if given."""
    return (
        not isinstance(value, (str, bytes))
        and isinstance(value, Sequence | np.ndarray)
        and (n is None or len(value) == n)
    )


def check_rank(api: str, argname: str, value: Any, n: int) -> int:
    """A rank within a group of ``n`` ranks: ``0 <= value < n``."""
    value = check_static_int(api, argname, value)
    if not 0 <= value < n:
        raise ValueError(
            f"{api}: {argname}={value} is out of range for a group of {n} ranks (0..{n - 1}). "
            f"Pass a rank between 0 and {n - 1}."
        )
    return value


def check_dim(api: str, argname: str, dim: Any, ndim: int) -> int:
    """A tensor dimension, negative values counting from the end."""
    dim = check_static_int(api, argname, dim)
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{api}: {argname}={dim} is out of range for an array of rank {ndim} "
            f"(valid: {-ndim}..{ndim - 1})."
        )
    return dim % ndim


def check_divisible(api: str, what: str, length: int, n: int, fix: str) -> None:
    """``length`` (a dimension) must split into ``n`` equal parts."""
    if length % n:
        raise ValueError(
            f"{api}: {what} has size {length}, which is not divisible by the group size {n}. {fix}"
        )


def check_leading(api: str, what: str, length: int, n: int, fix: str) -> None:
    """``length`` must equal ``n`` exactly (untiled scatter / all_to_all)."""
    if length != n:
        raise ValueError(
            f"{api}: {what} has size {length} but the group has {n} ranks; it must be exactly {n}. "
            f"{fix}"
        )


def as_array_leaves(api: str, x: Any) -> tuple[list[jax.Array], Any]:
    """Flatten a pytree and turn each leaf into a jax array, rejecting non-numeric leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(x)
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)):
            out.append(jnp.asarray(leaf))
            continue
        where = "x" if len(leaves) == 1 else f"leaf {i} of x"
        raise TypeError(
            f"{api}: {where} must be an array or a number, got {type(leaf).__name__} instead. "
            f"Collectives take arrays (or pytrees of arrays)."
        )
    return out, treedef


def map_leaves(api: str, x: Any, fn: Callable[[jax.Array], jax.Array]) -> Any:
    """``fn`` on every leaf of the pytree ``x`` (each checked by :func:`as_array_leaves`), in
    the same tree structure: the body of every per-leaf collective."""
    leaves, treedef = as_array_leaves(api, x)
    return jax.tree_util.tree_unflatten(treedef, [fn(leaf) for leaf in leaves])


def check_pairs(api: str, pairs: Any, n: int) -> tuple[tuple[int, int], ...]:
    """A partial permutation: (src, dst) pairs, each rank at most once as src and as dst."""
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence | set | frozenset):
        raise TypeError(
            f"{api}: pairs must be a sequence of (src, dst) rank pairs, got {pairs!r} instead."
        )
    out = []
    for p in pairs:
        if not (isinstance(p, Sequence) and len(p) == 2):
            raise TypeError(f"{api}: each entry of pairs must be a (src, dst) pair, got {p!r}.")
        src = check_rank(api, "pairs src", p[0], n)
        dst = check_rank(api, "pairs dst", p[1], n)
        out.append((src, dst))
    srcs = [s for s, _ in out]
    dsts = [d for _, d in out]
    for label, seq in (("sends", srcs), ("receives", dsts)):
        dup = sorted({r for r in seq if seq.count(r) > 1})
        if dup:
            raise ValueError(
                f"{api}: pairs={list(out)} is not a partial permutation: rank {dup[0]} {label} "
                f"more than once. Each rank may send at most once and receive at most once per "
                f"call; split the exchange into several calls."
            )
    return tuple(out)


def check_split(
    api: str, shape: tuple[int, ...], dim: Any, n: int, tiled: bool, argname: str = "dim"
) -> int:
    """The dimension that holds one slice per rank: size ``n`` (untiled) or a multiple of ``n``.

    Shared by scatter, reduce_scatter and all_to_all (and their group forms). Returns the
    dimension as a non-negative int.
    """
    label = f"`{argname}`" if argname == "dim" else argname
    if not shape:
        raise ValueError(
            f"{api}: x is a scalar, but it must hold {n} slices along {label} (one per rank)."
        )
    dim = check_dim(api, argname, dim, len(shape))
    what = f"x.shape[{dim}]" + ("" if argname in ("dim", "scatter_dimension") else f" ({argname})")
    if tiled:
        check_divisible(
            api,
            what,
            shape[dim],
            n,
            f"Pad {label} to a multiple of the group size, so that every rank gets an equal slice.",
        )
    else:
        check_leading(
            api,
            what,
            shape[dim],
            n,
            f"Stack one slice per rank along {label}, or use tiled=True to split a "
            f"longer dimension into equal chunks.",
        )
    return dim


def check_gather_dim(api: str, shape: tuple[int, ...], dim: Any, tiled: bool) -> int:
    """Where a gather puts the rank dimension: ``0..ndim`` (a new dimension) or, ``tiled``, an
    existing dimension ``0..ndim-1`` to concatenate along."""
    dim = check_static_int(api, "dim", dim)
    if not tiled:
        return check_dim(api, "dim", dim, len(shape) + 1)
    if not shape:
        raise ValueError(
            f"{api}: tiled=True concatenates along an existing dimension, but x is a "
            f"scalar. Use tiled=False to stack, or reshape x to 1-D."
        )
    return check_dim(api, "dim", dim, len(shape))


def check_sizes(api: str, sizes: Any, n: int, total: int, what: str) -> tuple[int, ...]:
    """Static sizes of the ``n`` parts, one per rank in rank order, that split ``total`` rows
    exactly (``what`` says where ``total`` comes from, e.g. ``"x has 8 rows"``)."""
    if not is_list(sizes):
        raise TypeError(
            f"{api}: sizes must be a list of {n} static ints, one per rank (the rows "
            f"of its part), got {sizes!r} of type {type(sizes).__name__} instead. "
            f"The sizes set the result's shape, so they cannot be traced."
        )
    if len(sizes) != n:
        raise ValueError(
            f"{api}: sizes={list(sizes)} has {len(sizes)} entries, but the group "
            f"has {n} ranks. Pass one size per rank: sizes[r] is the number of "
            f"rows rank r gets."
        )
    ints = tuple(check_static_int(api, f"sizes[{r}]", s) for r, s in enumerate(sizes))
    for r, s in enumerate(ints):
        if s < 0:
            raise ValueError(
                f"{api}: sizes[{r}]={s} is negative; sizes count rows and must be >= 0."
            )
    if sum(ints) != total:
        raise ValueError(
            f"{api}: sizes={list(ints)} sums to {sum(ints)}, but {what}. Each "
            f"rank's input is the {n} parts concatenated in rank order (torch's "
            f"input_list), so sum(sizes) must equal its length."
        )
    return ints
