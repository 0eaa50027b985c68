"""broadcast: every rank gets the value of rank ``src``."""

from __future__ import annotations

import jax

from .._core.axis import resolve
from .._core.checks import as_array_leaves, check_rank
from .._core.protocol import dispatch
from .._core.typing import AxisName, PyTree
from ..algorithms import registry


@dispatch
def broadcast(x: PyTree, axis_name: AxisName, src: int, *, algorithm: str = "auto") -> PyTree:
    """Every rank along ``axis_name`` gets rank ``src``'s ``x``.

    The SPMD counterpart of ``torch.distributed.broadcast(tensor, src)``. Equivalent to::

        def broadcast(x, axis_name, src):
            return x_of_rank(src)

    Lowering: one jaxcoll primitive with a lowering per platform: on GPU a single
    collective-broadcast (``lax.pbroadcast``, NCCL broadcast); XLA has no collective-broadcast
    on CPU or TPU, so there a binomial tree of ceil(log2 n) ``ppermute`` steps from ``src``.
    A program exported for a GPU and such a platform at once (``jax.export``,
    ``platforms=("cuda", "cpu")``) takes the tree on every platform, the GPU included, since
    XLA:CPU compiles the GPU's code of the module too; export for ``("cuda",)`` alone to keep
    the NCCL broadcast. Bit-exact (no arithmetic), for every dtype including bool and complex. The
    result is typed invariant (the same on every rank), so ``out_specs=P()`` checks; ``jax.grad``
    gives ``src`` the cotangent and every other rank zeros.

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
    ax = resolve("broadcast", axis_name)
    src = check_rank("broadcast", "src", src, ax.size)
    leaves, treedef = as_array_leaves("broadcast", x)
    out = registry.run(
        "broadcast", "broadcast", algorithm, leaves, ax, lambda mod, v, i: mod.broadcast(v, ax, src)
    )
    return jax.tree_util.tree_unflatten(treedef, out)
