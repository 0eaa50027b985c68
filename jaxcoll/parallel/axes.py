"""Whether a mesh axis is bound: the switch of model code that runs split or dense."""

from __future__ import annotations

from .._core.axis import bound
from .._core.typing import AxisName


def is_bound(axis_name: AxisName) -> bool:
    """Whether ``axis_name`` (a mesh axis, or a tuple of them) is bound where this is called:
    inside a ``jax.shard_map`` over a mesh with that axis (or ``pmap`` / ``vmap`` with that
    ``axis_name``).

    Model code written once for a layout and for one device branches on it: split where the
    Trainer's step binds the tensor or pipeline axis, dense elsewhere (a single-device run, a
    mesh without that axis, ``jax.jit`` with ``NamedSharding``). :mod:`jaxcoll.nn`'s layers
    and :func:`~jaxcoll.parallel.pipeline_apply` do it themselves. A tuple bound only in part
    raises ValueError.

    Example::

        >>> def block(params, h):
        ...     if parallel.is_bound("tensor"):
        ...         return parallel.mlp(params, h, "tensor")    # this device's slices
        ...     return parallel.gelu(h @ params["w1"]) @ params["w2"]   # dense
    """
    return bound("parallel.is_bound", axis_name)
