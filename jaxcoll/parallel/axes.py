"""Whether a mesh axis is bound: the switch of model code that runs split or dense."""

from __future__ import annotations

from .._core import roles
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
    raises ValueError. A role (``"tensor"``, ``"pipeline"``) is, inside a ``dp.Trainer``, the
    mesh axis its layout gives that role (not bound where the layout gives it none), as it is
    for every axis argument of :mod:`jaxcoll.parallel` and :mod:`jaxcoll.nn`.

    Example::

        >>> def block(params, h):
        ...     if parallel.is_bound("tensor"):
        ...         return parallel.mlp(params, h, "tensor")    # this device's slices
        ...     return parallel.gelu(h @ params["w1"]) @ params["w2"]   # dense
    """
    axis_name = roles.axis(axis_name)  # a role ("tensor") is the layout's axis for it
    return axis_name is not None and bound("parallel.is_bound", axis_name)
