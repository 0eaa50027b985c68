"""scan and exscan: inclusive and exclusive prefix reductions over ranks (MPI_Scan/Exscan)."""

from __future__ import annotations

from .._core import lowering
from .._core.axis import resolve
from .._core.checks import map_leaves
from .._core.ops import ReduceOp, accumulator, check_op_dtype, coerce_op
from .._core.protocol import dispatch
from .._core.typing import AxisName, PyTree


def _prefix(
    api: str, x: PyTree, axis_name: AxisName, op: ReduceOp | str, exclusive: bool
) -> PyTree:
    rop = coerce_op(api, op)
    ax = resolve(api, axis_name)

    def one(leaf):
        kind = check_op_dtype(api, rop, leaf.dtype)
        acc = accumulator(rop, leaf.dtype)  # float16 SUM/AVG add in float32, rounded once
        wide = leaf.astype(acc) if acc else leaf
        return lowering.scan(wide, ax, rop, kind, exclusive).astype(leaf.dtype)

    return map_leaves(api, x, one)


@dispatch
def scan(x: PyTree, axis_name: AxisName, op: ReduceOp | str = ReduceOp.SUM) -> PyTree:
    """Rank r gets ``op`` over the values of ranks 0..r (an inclusive prefix reduction).

    mpi4jax's ``scan`` (``MPI_Scan``); torch.distributed has none. Equivalent to::

        def scan(x, axis_name, op="sum"):
            xs = [x_of_rank(j) for j in range(rank(axis_name) + 1)]
            return functools.reduce(op, xs)           # AVG: sum(xs) / len(xs)

    Lowering: Hillis-Steele, ceil(log2 n) ``lax.ppermute`` steps (HLO collective-permute): in
    the step of distance d = 1, 2, 4, ... rank r >= d folds in the partial result of rank
    r - d. Every :class:`~jaxcoll.ReduceOp` its dtype allows (the table in
    :mod:`jaxcoll._core.ops`; torch's bool rules); AVG is the mean of ranks 0..r; MIN/MAX
    propagate NaN; float16 SUM/AVG accumulate in float32. Floats are folded in tree order, not
    left to right, so sums may differ from a sequential loop in the last bits. Differentiable
    for SUM and AVG (the gradient is the reversed suffix sum). Pytrees; the result is typed
    varying.

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names (ranks numbered row-major).
        op: a :class:`~jaxcoll.ReduceOp` or its name.

    Returns:
        A new pytree like ``x``.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: scan(v, "x"), mesh=mesh, in_specs=P("x"),
        ...                   out_specs=P("x"))
        >>> f(jnp.array([1.0, 2.0, 3.0, 4.0]))
        Array([ 1.,  3.,  6., 10.], dtype=float32)
    """
    return _prefix("scan", x, axis_name, op, exclusive=False)


@dispatch
def exscan(x: PyTree, axis_name: AxisName, op: ReduceOp | str = ReduceOp.SUM) -> PyTree:
    """Rank r gets ``op`` over the values of ranks 0..r-1; rank 0 gets the op's identity.

    mpi4jax's ``exscan`` (``MPI_Exscan``). MPI leaves rank 0's result undefined; here it is
    the identity of ``op`` (what an empty reduction gives): 0 for SUM, BOR, BXOR; 1 for
    PRODUCT; +inf / the dtype's max for MIN; -inf / the dtype's min for MAX; all bits set for
    BAND; for bool, False for SUM/MAX/BOR/BXOR and True for PRODUCT/MIN/BAND; and 0 for AVG
    (the mean of no values, taken as 0). Equivalent to::

        def exscan(x, axis_name, op="sum"):
            xs = [x_of_rank(j) for j in range(rank(axis_name))]
            if not xs:
                return jnp.full_like(x, identity(op))
            return functools.reduce(op, xs)           # AVG: sum(xs) / len(xs)

    Lowering: one ``lax.ppermute`` that shifts every value one rank up, then :func:`scan`'s
    Hillis-Steele steps: ceil(log2 n) + 1 collective-permutes. Ops, dtypes, pytrees and
    gradients as for :func:`scan`.

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        op: a :class:`~jaxcoll.ReduceOp` or its name.

    Returns:
        A new pytree like ``x``.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: exscan(v, "x", "max"), mesh=mesh, in_specs=P("x"),
        ...                   out_specs=P("x"))
        >>> f(jnp.array([3.0, 1.0, 4.0, 1.0]))
        Array([-inf,   3.,   3.,   4.], dtype=float32)
    """
    return _prefix("exscan", x, axis_name, op, exclusive=True)
