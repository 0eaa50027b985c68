"""What a Trainer's layout decides: its mesh, its data axes and its strategy's axes.

:func:`resolve` turns the Trainer's ``layout=``, ``mesh=``, ``axis_name=`` and ``sync=`` into
one consistent triple, so each role is said once: a layout given by degrees builds the mesh, a
layout naming data axes is the data axes (``axis_name=`` beside it is refused), and the
strategy is bound to the layout's shard axis (``sync=`` says *how* the data axes hold the
state, the layout *which* they are). Without data roles in the layout, ``axis_name=`` and
``FSDP(shard_axis=)`` say it, as before layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from .._core.typing import AxisName
from .._core.vma import axis_names
from .layout import Layout
from .sync import DDP, FSDP, Strategy, ZeRO1

# The default strategy without a layout's data roles: a frozen value, safe to share.
_DDP = DDP()


def resolve(
    api: str, layout: Any, mesh: Mesh | None, axis_name: AxisName | None, sync: Any
) -> tuple[Layout, Mesh, tuple, Strategy]:
    """``(layout, mesh, data_axes, sync)`` for a Trainer, each checked against the others."""
    if layout is None:
        layout = Layout()
    if not isinstance(layout, Layout):
        raise TypeError(
            f"{api}: layout must be a dp.Layout (e.g. dp.Layout(shard=4, tensor=2)), or None, "
            f"got {type(layout).__name__} instead."
        )
    if layout.by_degree:
        if mesh is not None:
            raise ValueError(
                f"{api}: {layout} gives degrees, so it builds the mesh itself; leave mesh= "
                f"out, or name the axes of your mesh in the layout (dp.Layout(shard='data', "
                f"tensor='model'))."
            )
        mesh = layout.make_mesh()
    if layout.data_axes:
        if axis_name is not None:
            raise ValueError(
                f"{api}: axis_name={axis_name!r} and {layout} both name the data axes; the "
                f"layout says them once (replicate=, shard=): leave axis_name out."
            )
        axis_name = layout.data_axes
    elif axis_name is None:
        axis_name = "data"
    if mesh is None:
        if isinstance(axis_name, (tuple, list)):
            raise ValueError(
                f"{api}: axis_name={axis_name!r} names several axes; pass the mesh that has them."
            )
        mesh = Mesh(np.array(jax.devices()), (axis_name,))
    if any(t != AxisType.Auto for t in mesh.axis_types):
        # jax.make_mesh's axes are Explicit (shardings in the types); the Trainer places
        # every array itself, with sharding constraints, which need Auto axes: the same
        # devices and names, Auto.
        mesh = Mesh(
            mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
        )
    names = axis_names(axis_name)
    missing = [a for a in names if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{api}: axis_name={axis_name!r} is not an axis of the mesh "
            f"(axes {mesh.axis_names}). Pass one of them."
        )
    layout.check(api, mesh, names)
    return layout, mesh, names, _strategy(api, layout, sync)


def _strategy(api: str, layout: Layout, sync: Any) -> Strategy:
    """``sync`` checked, defaulted and bound to the layout's shard axis."""
    if sync is not None and not isinstance(sync, Strategy):
        if isinstance(sync, type) and issubclass(sync, Strategy):
            raise TypeError(
                f"{api}: sync=dp.sync.{sync.__name__} is a class: pass a value, e.g. "
                f"sync=dp.sync.{sync.__name__}()."
            )
        raise TypeError(
            f"{api}: sync must be a gradient-sync strategy (dp.sync.DDP(), "
            f"dp.sync.ZeRO1() or dp.sync.FSDP()), got {sync!r} of type "
            f"{type(sync).__name__} instead."
        )
    shard = layout.shard_axis
    if shard is None:
        if sync is None:
            return _DDP
        if layout.data_axes and isinstance(sync, ZeRO1):  # FSDP is a ZeRO1
            raise ValueError(
                f"{api}: sync={type(sync).__name__}() splits the state over the data shards, "
                f"and {layout} has replicas only; give the layout a shard role "
                f"(dp.Layout(shard=...)) for {type(sync).__name__}, or use sync=dp.sync.DDP()."
            )
        return sync
    hybrid = len(layout.data_axes) > 1
    if sync is None:
        sync = FSDP()
    if not isinstance(sync, ZeRO1):
        raise ValueError(
            f"{api}: sync={type(sync).__name__}() keeps whole params and optimizer state on "
            f"every device, and {layout} shards them over {shard!r}; for replicas name the "
            f"role replicate= (dp.Layout(replicate=...)), or pass sync=dp.sync.FSDP() or "
            f"dp.sync.ZeRO1()."
        )
    if sync.shard_axis is not None and sync.shard_axis != shard:
        raise ValueError(
            f"{api}: sync={type(sync).__name__}(shard_axis={sync.shard_axis!r}) and {layout} "
            f"name different shard axes; the layout says it once: leave shard_axis out."
        )
    return dataclasses.replace(sync, shard_axis=shard if hybrid else None)
