"""shard_map's varying-axis types: read them, widen them, and mark a replicated result.

Inside ``jax.shard_map`` with checking on (``check_vma=True``, the default) every value is
typed *varying* over the mesh axes where devices may hold different values, and *invariant*
where they provably hold the same. jaxcoll keeps the types true:

* :func:`cast_varying` widens a value to varying (``lax.pcast``; no communication) where a
  pattern needs one type to start from;
* :func:`replicated` marks a value that an algorithm made bit-identical on every rank (a
  ppermute tree, a ring) as invariant, at no cost: it is the identity in the compiled program.

Under ``check_vma=False`` shard_map tracks no such types; both are then no-ops.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._jax import (
    Primitive,
    deflinear2,
    primitive_batchers,
    register_lowering,
    varying_of,
    with_varying,
)


def varying_axes(x: Any) -> frozenset | None:
    """The mesh axes ``x`` varies over (shard_map's check_vma type), or None if untyped."""
    if isinstance(x, jax.ShapeDtypeStruct):  # jax.eval_shape's result: its type as given
        return getattr(getattr(x, "manual_axis_type", None), "varying", None)
    return varying_of(jax.typeof(x))


def axis_names(axis_name: Any) -> tuple:
    """The mesh axis names of ``axis_name`` (one name, or a tuple or list of them), as a tuple."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _lax_name(names: tuple) -> Any:
    return names[0] if len(names) == 1 else names


def types_tracked(names: tuple) -> bool:
    """Whether shard_map tracks varying types over ``names`` here (``check_vma=True``).

    The axis index is typed varying exactly when types are tracked.
    """
    probe = lax.axis_index(_lax_name(names))
    return bool(set(names) & set(varying_axes(probe) or ()))


def cast_varying(x: jax.Array, names: tuple) -> jax.Array:
    """Mark ``x`` varying over the mesh axes ``names`` where it is typed invariant.

    A no-op under ``check_vma=False``, where shard_map tracks no such types.
    """
    vma = varying_axes(x)
    if vma is None:
        return x
    missing = tuple(a for a in names if a not in vma)
    if not missing or not types_tracked(names):
        return x
    return lax.pcast(x, missing, to="varying")


def to_varying(tree: Any, names: tuple) -> Any:
    """:func:`cast_varying` on every leaf of the pytree ``tree``.

    The data-parallel step marks its params varying with it before ``jax.grad``, so the
    gradient is each rank's own and no reduction is inserted behind the strategy's back.
    """
    return jax.tree_util.tree_map(lambda x: cast_varying(x, names), tree)


def ensure_varying(x: jax.Array, ax: Any) -> jax.Array:
    """:func:`cast_varying` over every name of a resolved axis ``ax``."""
    return cast_varying(x, axis_names(ax.name))


def _without(aval: Any, axes: tuple) -> Any:
    """``aval`` typed invariant over ``axes`` (unchanged when it carries no such types)."""
    varying = varying_of(aval)
    if varying is None:
        return aval
    return with_varying(aval, frozenset(a for a in varying if a not in axes))


def root_cotangent(ct: jax.Array, names: tuple, root: int) -> jax.Array:
    """The cotangent of a varying input whose rank ``root`` alone fed an output.

    With types tracked, the output's cotangent is invariant (one value): ``root`` gets it,
    every other rank zeros. Untracked, each rank holds its own cotangent: they are summed.
    """
    name = _lax_name(names)
    if types_tracked(names):
        ct = cast_varying(ct, names)
    else:
        ct = lax.psum(ct, name)
    return jnp.where(lax.axis_index(name) == root, ct, jnp.zeros_like(ct))


# The replicated cast: varying -> invariant, for values equal on every rank. Identity in the
# program. Its transpose reads the value as "rank 0's copy" (equal to every other copy), so the
# cotangent goes to rank 0 alone: exact, and what the algorithm's own transpose then spreads.
replicated_p = Primitive("jaxcoll_replicated")
replicated_p.def_impl(lambda x, *, axes: x)
replicated_p.def_abstract_eval(lambda aval, *, axes: _without(aval, axes))
register_lowering(replicated_p, lambda ctx, x, *, axes: [x])
deflinear2(replicated_p, lambda ct, x, *, axes: [root_cotangent(ct, axes, 0)])
primitive_batchers[replicated_p] = lambda vals, dims, *, axes: (
    replicated_p.bind(vals[0], axes=axes),
    dims[0],
)


def replicated(x: jax.Array, ax: Any) -> jax.Array:
    """Type ``x`` invariant over ``ax``: only for values bit-identical on every rank.

    Used by algorithms that end in ``ppermute`` steps (which jax types varying) but leave every
    rank the same bits: the tree all-reduce, tree/ring broadcast, Bruck and ring all-gather.
    No communication and no op in the compiled program; a no-op when types are not tracked.
    """
    names = axis_names(ax.name)
    vma = varying_axes(x)
    if not vma or not set(names) & set(vma) or not types_tracked(names):
        return x
    return replicated_p.bind(x, axes=tuple(a for a in names if a in vma))


def as_invariant(x: jax.Array, names: tuple) -> jax.Array:
    """Type ``x`` invariant over the mesh axes ``names`` (the replicated cast, see
    :func:`replicated`): only for values bit-identical over those axes, e.g. the result of
    an all-reduce over them that was typed varying again. No op in the compiled program."""
    vma = varying_axes(x)
    axes = tuple(a for a in names if vma and a in vma)
    if not axes or not types_tracked(axes):
        return x
    return replicated_p.bind(x, axes=axes)
