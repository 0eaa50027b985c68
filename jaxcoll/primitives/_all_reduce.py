"""all_reduce and reduce: combine every rank's value with a :class:`~jaxcoll.ReduceOp`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core.axis import Axis, resolve
from .._core.checks import as_array_leaves, check_rank
from .._core.ops import ReduceOp, accumulator, check_op_dtype, coerce_op
from .._core.protocol import dispatch
from .._core.typing import AxisName, PyTree
from ..algorithms import registry


def _validated(
    api: str, x: PyTree, axis_name: AxisName, op: ReduceOp | str
) -> tuple[ReduceOp, Axis, list[jax.Array], list[str], Any]:
    rop = coerce_op(api, op)
    ax = resolve(api, axis_name)
    leaves, treedef = as_array_leaves(api, x)
    kinds = [check_op_dtype(api, rop, leaf.dtype) for leaf in leaves]
    return rop, ax, leaves, kinds, treedef


def _in_accumulator(
    op: ReduceOp, leaves: list[jax.Array], run: Callable[[list[jax.Array]], list[jax.Array]]
) -> list[jax.Array]:
    """Run the reduction with each leaf in its accumulation dtype (float16 SUM/AVG in
    float32: see :func:`jaxcoll._core.ops.accumulator`); results come back in the leaf's."""
    wide = [leaf.astype(acc) if (acc := accumulator(op, leaf.dtype)) else leaf for leaf in leaves]
    return [
        out if out.dtype == leaf.dtype else out.astype(leaf.dtype)
        for out, leaf in zip(run(wide), leaves, strict=True)
    ]


@dispatch
def all_reduce(
    x: PyTree, axis_name: AxisName, op: ReduceOp | str = ReduceOp.SUM, *, algorithm: str = "auto"
) -> PyTree:
    """Combine ``x`` over every rank along ``axis_name``; every rank gets the result.

    The SPMD counterpart of ``torch.distributed.all_reduce(tensor, op)``. Call it inside
    ``jax.shard_map``. Equivalent to::

        def all_reduce(x, axis_name, op):
            xs = [x_of_rank(j) for j in range(world_size(axis_name))]
            return functools.reduce(op, xs)        # AVG: sum(xs) / n

    Lowering (per leaf):

    * SUM, AVG, MIN, MAX: one native all-reduce (``lax.psum`` / ``pmean`` / ``pmin`` /
      ``pmax``), which XLA lowers to NCCL on GPU.
    * bool SUM, MAX, BOR (logical or) -> ``pmax``; bool PRODUCT, MIN, BAND (logical and) ->
      ``pmin``: torch's rules for bool tensors.
    * PRODUCT, BAND, BOR, BXOR (lax has no such collective): ``all_to_all`` + one local reduce
      (a reduce-scatter) then ``all_gather``. Exact (PRODUCT multiplies; no log/exp)
      and bit-identical on every rank; moves 2(n-1)/n of x per rank, like a ring.

    Args:
        x: an array or a pytree of arrays; every leaf is reduced.
        axis_name: the mesh axis to reduce over, or a tuple of axes (their product).
        op: a :class:`~jaxcoll.ReduceOp` or its name. See :mod:`jaxcoll._ops` for which
            dtypes each op allows; any other pairing raises TypeError at trace time.
        algorithm: ``"native"`` (the lowering above), ``"ring"``, ``"tree"``,
            ``"hierarchical"`` (tuple axis_name) or ``"auto"`` (the measured winner; native
            for small messages on CPU). See :mod:`jaxcoll.algorithms`.

    Returns:
        A new pytree like ``x``, the same on every rank.

    Note:
        torch reduces in place and returns None; here the result is a *new* array and ``x`` is
        unchanged. Calling it twice reduces twice: the reason values "grow" when a training
        loop all-reduces already-reduced gradients.

    Example (8 devices)::

        >>> mesh = jax.make_mesh((8,), ("x",))
        >>> f = jax.shard_map(lambda v: all_reduce(v, "x", op="max"), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.arange(8.0))
        Array([7., 7., 7., 7., 7., 7., 7., 7.], dtype=float32)
    """
    rop, ax, leaves, kinds, treedef = _validated("all_reduce", x, axis_name, op)
    out = _in_accumulator(
        rop,
        leaves,
        lambda wide: registry.run(
            "all_reduce",
            "all_reduce",
            algorithm,
            wide,
            ax,
            lambda mod, v, i: mod.all_reduce(v, ax, rop, kinds[i]),
        ),
    )
    return jax.tree_util.tree_unflatten(treedef, out)


@dispatch
def reduce(
    x: PyTree,
    axis_name: AxisName,
    dst: int,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    algorithm: str = "auto",
) -> PyTree:
    """Combine ``x`` over every rank; rank ``dst`` gets the result, every other rank its own x.

    The SPMD counterpart of ``torch.distributed.reduce(tensor, dst, op)``. Equivalent to::

        def reduce(x, axis_name, dst, op):
            total = all_reduce(x, axis_name, op)
            return total if rank(axis_name) == dst else x

    Lowering: :func:`all_reduce` followed by a select on the rank (lax has no rooted reduce;
    ``algorithm="tree"`` in the algorithms module gives a binomial-tree reduce).

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        dst: the rank (``0 <= dst < world_size``) that receives the result; a static int.
        op: a :class:`~jaxcoll.ReduceOp` or its name.
        algorithm: ``"native"``, ``"ring"``, ``"tree"`` (binomial tree to ``dst``),
            ``"hierarchical"`` or ``"auto"``; see :mod:`jaxcoll.algorithms`.

    Returns:
        A new pytree: the reduction on ``dst``, an unchanged copy of ``x`` elsewhere.

    Note:
        With torch the non-destination tensors are left in an unspecified state by some
        backends; here they are guaranteed to be the rank's own input, never touched.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: reduce(v, "x", dst=0), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.array([1.0, 2.0, 3.0, 4.0]))
        Array([10., 2., 3., 4.], dtype=float32)
    """
    rop, ax, leaves, kinds, treedef = _validated("reduce", x, axis_name, op)
    dst = check_rank("reduce", "dst", dst, ax.size)
    out = _in_accumulator(
        rop,
        leaves,
        lambda wide: registry.run(
            "reduce",
            "reduce",
            algorithm,
            wide,
            ax,
            lambda mod, v, i: mod.reduce(v, ax, dst, rop, kinds[i]),
        ),
    )
    return jax.tree_util.tree_unflatten(treedef, out)
