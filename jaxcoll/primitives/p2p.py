"""Point-to-point: sendrecv (a partial permutation) and shift (the ring step)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import as_array_leaves, check_pairs, check_static_int
from .._typing import AxisName, PyTree
from ._axis import Axis, resolve
from ._group import group_op, is_group
from ._lowering import ensure_varying, is_rank, staged


def sendrecv(x: PyTree, axis_name: AxisName, pairs: Sequence[tuple[int, int]]) -> PyTree:
    """Each ``(src, dst)`` in ``pairs`` sends ``src``'s ``x`` to ``dst``, all at once.

    The SPMD counterpart of matched ``torch.distributed.send(tensor, dst)`` /
    ``recv(tensor, src)`` calls (or a ``batch_isend_irecv`` list). Equivalent to::

        def sendrecv(x, axis_name, pairs):
            senders = {dst: src for src, dst in pairs}
            r = rank(axis_name)
            return x_of_rank(senders[r]) if r in senders else x

    Lowering: one ``lax.ppermute`` (HLO collective-permute, which XLA lowers to NCCL send/recv
    on GPU and runs on CPU too) plus a select that lets non-receivers keep their own ``x``.
    ``lax.psend``/``precv`` are GPU-only and reject cycles, so they are not used. Bit-exact, any
    dtype; ``jax.grad`` sends the cotangents back along the reversed pairs.

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        pairs: ``(src, dst)`` rank pairs forming a partial permutation: each rank sends at most
            once and receives at most once. Cycles (``[(0, 1), (1, 0)]``) are fine: every
            transfer happens at once, so there is no send/recv ordering to deadlock on.

    Returns:
        A new pytree: the sender's ``x`` on each ``dst``, the rank's own ``x`` elsewhere.

    Note:
        torch's ``recv`` writes into a buffer; here non-receiving ranks keep their input
        (``lax.ppermute`` alone would give them zeros).

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: sendrecv(v, "x", [(0, 3)]), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.array([10.0, 1.0, 2.0, 3.0]))
        Array([10.,  1.,  2., 10.], dtype=float32)
    """
    if is_group(axis_name):
        return group_op("sendrecv", x, axis_name, pairs=pairs)
    ax = resolve("sendrecv", axis_name)
    pairs = check_pairs("sendrecv", pairs, ax.size)
    leaves, treedef = as_array_leaves("sendrecv", x)
    if not pairs:
        return jax.tree_util.tree_unflatten(treedef, leaves)
    out = [_sendrecv_leaf(leaf, ax, pairs) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


@staged(1, 2)
def _sendrecv_leaf(x: jax.Array, ax: Axis, pairs: tuple[tuple[int, int], ...]) -> jax.Array:
    x = ensure_varying(x, ax)
    got = lax.ppermute(x, ax.name, perm=pairs)
    return jnp.where(is_rank(ax, [d for _, d in pairs]), got, x)


def shift(x: PyTree, axis_name: AxisName, offset: int = 1) -> PyTree:
    """Rank r gets the ``x`` of rank ``(r - offset) mod n``: one step around the ring.

    Equivalent to::

        def shift(x, axis_name, offset=1):
            return x_of_rank((rank(axis_name) - offset) % n)

    Lowering: one ``lax.ppermute`` with the cyclic permutation ``i -> (i + offset) mod n``
    (HLO collective-permute); no communication when ``offset`` is a multiple of n. Any dtype;
    ``jax.grad`` shifts the cotangent by ``-offset``.

    Args:
        x: an array or a pytree of arrays.
        axis_name: mesh axis name or tuple of names.
        offset: how many ranks forward to send (negative sends backward); a static int.

    Returns:
        A new pytree.

    Example (4 devices)::

        >>> f = jax.shard_map(lambda v: shift(v, "x"), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.array([0.0, 1.0, 2.0, 3.0]))
        Array([3., 0., 1., 2.], dtype=float32)
    """
    if is_group(axis_name):
        return group_op("shift", x, axis_name, offset=offset)
    ax = resolve("shift", axis_name)
    offset = check_static_int("shift", "offset", offset)
    leaves, treedef = as_array_leaves("shift", x)
    n = ax.size
    k = offset % n
    if k == 0:
        return jax.tree_util.tree_unflatten(treedef, leaves)
    perm = [(i, (i + k) % n) for i in range(n)]
    out = [lax.ppermute(leaf, ax.name, perm=perm) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)
