"""broadcast: every rank gets the value of rank ``src``."""

from __future__ import annotations

import jax

from .._checks import as_array_leaves, check_rank
from .._typing import AxisName, PyTree
from ._axis import resolve
from ._group import group_op, is_group
from ._lowering import native_broadcast


def broadcast(x: PyTree, axis_name: AxisName, src: int, *, algorithm: str = "auto") -> PyTree:
    """Every rank along ``axis_name`` gets rank ``src``'s ``x``.

    The SPMD counterpart of ``torch.distributed.broadcast(tensor, src)``. Equivalent to::

        def broadcast(x, axis_name, src):
            return x_of_rank(src)

    Lowering: on GPU a single collective-broadcast (``lax.pbroadcast``, NCCL broadcast). XLA has
    no collective-broadcast on CPU or TPU, so there ``lax.platform_dependent`` selects a
    binomial tree of ceil(log2 n) ``ppermute`` steps from ``src``. Both are bit-exact (no
    arithmetic), for every dtype including bool and complex. ``jax.grad`` sums the cotangents
    of all ranks onto ``src`` (zeros elsewhere).

    Args:
        x: an array or a pytree of arrays. Only ``src``'s values matter; other ranks' ``x``
            give the shape and dtype, which must agree as everywhere under SPMD.
        axis_name: mesh axis name or tuple of names.
        src: the source rank, a static int in ``0..world_size-1``.
        algorithm: ``"native"`` (the lowering above), ``"ring"`` (bandwidth-optimal),
            ``"tree"``, ``"hierarchical"`` (tuple axis_name) or ``"auto"``; see
            :mod:`jaxcoll.algorithms`.

    Returns:
        A new pytree equal to ``src``'s ``x`` on every rank.

    Note:
        torch overwrites the tensor in place on the receivers; here ``x`` is never modified.

    Example (4 devices, as in the torch tutorial)::

        >>> f = jax.shard_map(lambda v: broadcast(v, "x", src=0), mesh=mesh,
        ...                   in_specs=P("x"), out_specs=P("x"))
        >>> f(jnp.array([1.0, 0.0, 0.0, 0.0]))
        Array([1., 1., 1., 1.], dtype=float32)
    """
    if is_group(axis_name):
        return group_op("broadcast", x, axis_name, src=src)
    ax = resolve("broadcast", axis_name)
    src = check_rank("broadcast", "src", src, ax.size)
    leaves, treedef = as_array_leaves("broadcast", x)
    from ..algorithms import _dispatch  # lazy: the algorithms build on this module

    done = _dispatch.broadcast("broadcast", algorithm, leaves, ax, src)
    if done is not None:
        return jax.tree_util.tree_unflatten(treedef, done)
    out = [native_broadcast(leaf, ax, src) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)
