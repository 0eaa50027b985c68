"""rank and world_size: where this device sits along ``axis_name``, and how many ranks."""

from __future__ import annotations

import jax

from .._core.axis import resolve
from .._core.protocol import dispatch
from .._core.typing import AxisName


@dispatch
def rank(axis_name: AxisName) -> jax.Array:
    """This device's rank along ``axis_name``: an int32 scalar in ``0..world_size-1``.

    Equivalent to ``jax.lax.axis_index(axis_name)``; over a tuple of names the ranks are
    numbered row-major (the last name varies fastest), like every jaxcoll collective. For a
    group passed as ``axis_name``, the rank within the group (-1 on non-members).

    Note:
        torch's ``get_rank()`` names a process; here a rank is a device position along a mesh
        axis, and the value is traced (it differs per device inside one SPMD program).

    Example (4 devices)::

        >>> mesh = jax.make_mesh((4,), ("x",))
        >>> f = jax.shard_map(lambda: rank("x")[None], mesh=mesh, in_specs=(), out_specs=P("x"))
        >>> f()
        Array([0, 1, 2, 3], dtype=int32)
    """
    return resolve("rank", axis_name).rank()


@dispatch
def world_size(axis_name: AxisName) -> int:
    """The number of ranks along ``axis_name`` (the product over a tuple of names).

    Equivalent to ``jax.lax.axis_size(axis_name)``. A Python int, known at trace time. For a
    group passed as ``axis_name``, the group's size.
    """
    return resolve("world_size", axis_name).size
