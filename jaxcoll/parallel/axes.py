"""Whether a mesh axis is bound: the switch of model code that runs split or dense."""

from __future__ import annotations

from typing import Any

from .._core import roles
from .._core.axis import bound
from .._core.typing import AxisName


def is_bound(axis_name: AxisName) -> bool:
    """Whether ``axis_name`` (a mesh axis, or a tuple of them) is bound where this is called:
    inside a ``jax.shard_map`` over a mesh with that axis (or ``pmap`` / ``vmap`` with that
    ``axis_name``).

    Model code written once for a layout and for one device branches on it: split where the
    Trainer's step binds the tensor or pipeline axis, dense elsewhere (a single-device run, a
    mesh without that axis, ``jax.jit`` with ``NamedSharding``). :mod:`jaxcoll.nn`'s layers,
    :mod:`jaxcoll.parallel`'s tensor- and context-parallel functions and
    :func:`~jaxcoll.parallel.pipeline_loss` do it themselves. A tuple bound only in part
    raises ValueError. A role (``"tensor"``, ``"pipeline"``) is, inside a ``dp.Trainer``, the
    mesh axis its layout gives that role (not bound where the layout gives it none), as it is
    for every ``axis_name`` argument of :mod:`jaxcoll.parallel` and :mod:`jaxcoll.nn`.

    Example::

        >>> def block(params, h):
        ...     if parallel.is_bound("tensor"):
        ...         return my_split_block(params, h)    # this device's slices
        ...     return my_dense_block(params, h)        # the whole params
    """
    return bound_axis(axis_name, "parallel.is_bound") is not None


def bound_axis(axis_name: AxisName, api: str) -> Any:
    """The mesh axis ``axis_name`` stands for (a role: the layout's axis for it) where it is
    bound, else None (the caller runs dense); ``api`` names the caller in the error for a
    tuple bound only in part."""
    axis = roles.axis(axis_name)
    if axis is None or not bound(api, axis):
        return None
    return axis
