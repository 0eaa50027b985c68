"""Point-to-point: sendrecv (a partial permutation) and shift (the ring step)."""

from __future__ import annotations

from collections.abc import Sequence

from .._core import lowering
from .._core.axis import resolve
from .._core.checks import check_pairs, check_static_int, map_leaves
from .._core.protocol import dispatch
from .._core.typing import AxisName, PyTree


@dispatch
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
    ax = resolve("sendrecv", axis_name)
    pairs = check_pairs("sendrecv", pairs, ax.size)
    return map_leaves(
        "sendrecv", x, lambda leaf: lowering.sendrecv(leaf, ax, pairs) if pairs else leaf
    )


@dispatch
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
    ax = resolve("shift", axis_name)
    offset = check_static_int("shift", "offset", offset)
    return map_leaves("shift", x, lambda leaf: lowering.shift(leaf, ax, offset))
