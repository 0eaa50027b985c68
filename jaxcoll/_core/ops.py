"""Reduction operators: the `ReduceOp` enum, which dtypes each op accepts, and how to fold.

The dtype rules follow torch.distributed where it has one and NumPy otherwise:

=========  =========================================================================
op         allowed dtypes
=========  =========================================================================
SUM        bool (logical or, as torch does), integers, floats, complex
AVG        floats, complex (an integer mean would truncate: use SUM and divide)
PRODUCT    bool (logical and, as torch does), integers, floats, complex; exact
MIN, MAX   bool, integers, floats (complex has no order)
BAND/BOR/  bool, integers
BXOR
=========  =========================================================================
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["ReduceOp"]


class ReduceOp(str, enum.Enum):
    """How a reducing collective combines the ranks' values.

    Members compare equal to their lower-case names, so ``op="max"`` and
    ``op=ReduceOp.MAX`` are the same thing.

    Example:
        >>> from jaxcoll import ReduceOp
        >>> ReduceOp("max") is ReduceOp.MAX
        True
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __str__(self) -> str:
        return f"ReduceOp.{self.name}"

    @classmethod
    def _missing_(cls, value: object) -> ReduceOp | None:
        if isinstance(value, str):
            key = value.strip().lower()
            aliases = {"mean": "avg", "prod": "product", "and": "band", "or": "bor", "xor": "bxor"}
            key = aliases.get(key, key)
            for member in cls:
                if member.value == key:
                    return member
        return None


_ALL = tuple(ReduceOp)
_EXACT = tuple(op for op in ReduceOp if op is not ReduceOp.AVG)  # bool and integer data
_ALLOWED: dict[str, tuple[ReduceOp, ...]] = {
    "bool": _EXACT,
    "integer": _EXACT,
    "floating": (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX),
    "complex": (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT),
}

_FIX = {
    ReduceOp.AVG: "cast to a floating dtype first, or use SUM and divide by the group size",
    ReduceOp.MIN: "compare real parts or magnitudes explicitly (complex numbers have no order)",
    ReduceOp.MAX: "compare real parts or magnitudes explicitly (complex numbers have no order)",
    ReduceOp.BAND: "bitwise ops need integer or bool data; use MIN/MAX or cast",
    ReduceOp.BOR: "bitwise ops need integer or bool data; use MIN/MAX or cast",
    ReduceOp.BXOR: "bitwise ops need integer or bool data; cast to an integer dtype",
}


def dtype_kind(dtype: np.dtype) -> str:
    """Classify a dtype as 'bool', 'integer', 'floating' or 'complex'."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "bool"
    if jnp.issubdtype(dtype, jnp.integer):
        return "integer"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex"
    if jnp.issubdtype(dtype, jnp.floating):
        return "floating"
    raise TypeError(f"unsupported dtype {dtype}")


def coerce_op(api: str, op: object) -> ReduceOp:
    """Turn ``op`` (a ReduceOp or its name) into a ReduceOp, or raise a clear error."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op)
        except ValueError:
            pass
        names = ", ".join(m.name for m in ReduceOp)
        raise ValueError(
            f"{api}: op={op!r} is not a reduce op. Expected one of {names} "
            f"(a jaxcoll.ReduceOp or its name, e.g. 'max')."
        )
    # torch's ReduceOp members, or anything with a matching `name`, are accepted by name.
    name = getattr(op, "name", None)
    if isinstance(name, str):
        return coerce_op(api, name)
    raise TypeError(
        f"{api}: op must be a jaxcoll.ReduceOp or its name as a string, got {op!r} "
        f"of type {type(op).__name__} instead."
    )


def check_op_dtype(api: str, op: ReduceOp, dtype: np.dtype) -> str:
    """Raise TypeError unless ``op`` is defined for ``dtype``; return the dtype kind."""
    try:
        kind = dtype_kind(dtype)
    except TypeError:
        raise TypeError(f"{api}: dtype {np.dtype(dtype)} is not supported by collectives") from None
    allowed = _ALLOWED[kind]
    if op not in allowed:
        ok = ", ".join(m.name for m in allowed)
        raise TypeError(
            f"{api}: op={op} is not defined for dtype {np.dtype(dtype).name}. "
            f"For {kind} data the allowed ops are {ok}; fix: {_FIX.get(op, 'pick one of them')}."
        )
    return kind


@dataclass(frozen=True)
class Rule:
    """How one op combines values of one dtype kind: the one table every lowering reads.

    Attributes:
        combine: the binary function folding two ranks' values (ring and tree steps).
        reduce: reduces a stacked ``(n, ...)`` array over its leading axis in one XLA reduce.
        native: the lax collective that computes the op over an axis, or None where lax has
            none (PRODUCT, bitwise ops): those lower to all_to_all + ``reduce`` + all_gather.
    """

    combine: Callable[[jax.Array, jax.Array], jax.Array]
    reduce: Callable[[jax.Array], jax.Array]
    native: Callable[..., jax.Array] | None


def _over_ranks(fn: Callable[..., jax.Array]) -> Callable[[jax.Array], jax.Array]:
    return lambda stacked: fn(stacked, axis=0)


def _lax_reduce(fn: Callable[..., jax.Array]) -> Callable[[jax.Array], jax.Array]:
    return lambda stacked: fn(stacked, (0,))


_OR = Rule(jnp.logical_or, _lax_reduce(lax.reduce_or), lax.pmax)
_AND = Rule(jnp.logical_and, _lax_reduce(lax.reduce_and), lax.pmin)
_RULES: dict[tuple[str, ReduceOp], Rule] = {
    # torch's rules for bool: SUM and MAX are logical or, PRODUCT and MIN logical and.
    ("bool", ReduceOp.SUM): _OR,
    ("bool", ReduceOp.MAX): _OR,
    ("bool", ReduceOp.BOR): _OR,
    ("bool", ReduceOp.PRODUCT): _AND,
    ("bool", ReduceOp.MIN): _AND,
    ("bool", ReduceOp.BAND): _AND,
    ("bool", ReduceOp.BXOR): Rule(jnp.logical_xor, _lax_reduce(lax.reduce_xor), None),
    ("number", ReduceOp.SUM): Rule(jnp.add, _over_ranks(jnp.sum), lax.psum),
    ("number", ReduceOp.AVG): Rule(jnp.add, _over_ranks(jnp.mean), lax.pmean),
    ("number", ReduceOp.PRODUCT): Rule(jnp.multiply, _over_ranks(jnp.prod), None),
    ("number", ReduceOp.MIN): Rule(jnp.minimum, _over_ranks(jnp.min), lax.pmin),
    ("number", ReduceOp.MAX): Rule(jnp.maximum, _over_ranks(jnp.max), lax.pmax),
    ("number", ReduceOp.BAND): Rule(jnp.bitwise_and, _lax_reduce(lax.reduce_and), None),
    ("number", ReduceOp.BOR): Rule(jnp.bitwise_or, _lax_reduce(lax.reduce_or), None),
    ("number", ReduceOp.BXOR): Rule(jnp.bitwise_xor, _lax_reduce(lax.reduce_xor), None),
}


def rule(op: ReduceOp, kind: str) -> Rule:
    """The :class:`Rule` of ``op`` on data of ``kind`` (from :func:`check_op_dtype`)."""
    return _RULES[("bool" if kind == "bool" else "number", op)]


def combine_fn(op: ReduceOp, kind: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The binary function that folds two ranks' values for ``op`` on data of ``kind``.

    AVG folds with ``+``; the caller divides the finished sum by n once.
    """
    return rule(op, kind).combine


def fold(op: ReduceOp, kind: str, stacked: jax.Array) -> jax.Array:
    """Reduce ``stacked`` over its leading axis (the ``n`` ranks) with ``op``, in one XLA reduce.

    Callers reduce each chunk exactly once and then share it (reduce-scatter + all-gather), so
    the result is bit-identical on every rank even for float PRODUCT. AVG divides the sum by n.
    """
    return rule(op, kind).reduce(stacked).astype(stacked.dtype)


def finish_avg(x: jax.Array, op: ReduceOp, n: int) -> jax.Array:
    """AVG folds with ``+``; divide the finished sum by the group size once."""
    if op is ReduceOp.AVG:
        return (x / jnp.asarray(n, x.dtype)).astype(x.dtype)
    return x


def accumulator(op: ReduceOp, dtype: np.dtype) -> np.dtype | None:
    """The dtype a reduction of ``dtype`` data runs in, where that is not ``dtype`` itself.

    float16 SUM and AVG run in float32 (result cast back once): XLA:CPU adds float16 in
    float16 rank by rank, and NCCL reduces half in half, so n = 5 values near 1000 sum to
    5672 instead of 5680. bfloat16 already accumulates in float32 on CPU.
    """
    if np.dtype(dtype) == np.float16 and op in (ReduceOp.SUM, ReduceOp.AVG):
        return np.dtype(np.float32)
    return None
