"""The layout bound to one mesh: :class:`BoundLayout`, the one value a Trainer keeps, and the
checks :meth:`Layout.bind <jaxcoll.dp.Layout.bind>` makes of a layout against its mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from ..._core import roles
from ..._core.roles import Role
from ..._core.typing import AxisName
from ._split import BatchSplit

#: The data axis of a layout that names none (``Trainer(loss_fn, opt)`` on every device).
DEFAULT_DATA_AXIS = "data"
#: The roles with mesh axes of their own (the experts borrow the data shards').
AXIS_ROLES = (Role.REPLICATE, Role.SHARD, Role.CONTEXT, Role.TENSOR, Role.PIPELINE)


def _auto(mesh: Mesh) -> Mesh:
    """``mesh`` with Auto axes: jax.make_mesh's axes are Explicit (shardings in the types);
    the Trainer places every array itself, with sharding constraints, which need Auto axes:
    the same devices and names, Auto."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def bind(layout: Any, api: str, mesh: Mesh | None) -> BoundLayout:
    """``layout`` bound to ``mesh`` (:meth:`Layout.bind`), its errors naming ``api``."""
    if layout.by_degree:
        if mesh is not None:
            raise ValueError(
                f"{api}: {layout!r} gives degrees, so it builds the mesh itself; leave "
                f"mesh= out, or name the axes of your mesh in the layout "
                f"(dp.Layout(shard='data', tensor='model'))."
            )
        mesh = layout.make_mesh()
    data = layout.data_axes or (DEFAULT_DATA_AXIS,)
    if mesh is None:
        if len(data) > 1:
            raise ValueError(
                f"{api}: {layout!r} names the data axes {data}; pass the mesh that has "
                f"them (mesh=)."
            )
        mesh = Mesh(np.array(jax.devices()), data)
    mesh = _auto(mesh)
    if not layout.data_axes and DEFAULT_DATA_AXIS not in mesh.axis_names:
        raise ValueError(
            f"{api}: the data axis {DEFAULT_DATA_AXIS!r} ({layout!r} names none: the "
            f"default) is not an axis of the mesh (axes {mesh.axis_names}); name the "
            f"mesh's data axes in the layout, e.g. "
            f"layout=dp.Layout(replicate={mesh.axis_names[0]!r})."
        )
    _check(layout, api, mesh, data)
    context = layout.context_axis
    examples = tuple(a for a in data if a != context)  # the batch's examples split
    split = BatchSplit(
        examples[0] if len(examples) == 1 else examples,
        int(np.prod([mesh.shape[a] for a in examples])),
        context,
        1 if context is None else int(mesh.shape[context]),
    )
    return BoundLayout(layout, mesh, data, split, layout._binding(data))


def _check(layout: Any, api: str, mesh: Mesh, data_axes: tuple) -> None:
    """Raise ValueError if an axis of the layout is not an axis of ``mesh``, a model
    axis is also a data axis, or the expert axis is none (or its size not the expert
    degree)."""
    e = layout.expert_axis
    if e is not None and (e not in data_axes or e not in mesh.axis_names):
        raise ValueError(
            f"{api}: layout expert={e!r} is not one of the data axes {data_axes}; the "
            f"experts borrow the devices of the data shards (or replicas): name that axis."
        )
    if e is not None and isinstance(layout.expert, int) and mesh.shape[e] != layout.expert:
        raise ValueError(
            f"{api}: layout expert={layout.expert} borrows the {e!r} axis, of size "
            f"{mesh.shape[e]}; give expert={mesh.shape[e]} (the experts' degree is that "
            f"axis's)."
        )
    for role in AXIS_ROLES:
        for axis in layout._names(role):
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{api}: layout {role}={axis!r} is not an axis of the mesh (axes "
                    f"{mesh.axis_names}). Pass one of them, or a mesh with that axis."
                )
            if role in roles.MODEL_ROLES and axis in data_axes:
                raise ValueError(
                    f"{api}: layout {role}={axis!r} is also a data axis (data axes "
                    f"{data_axes!r}); an axis has one role. Split the batch over the other "
                    f"axes or give the {role} role another axis."
                )


def _layout_axis(role: Role) -> Any:
    """The property of a bound layout that is its layout's mesh axis of ``role``, or None."""

    def axis(self: BoundLayout) -> str | None:
        return getattr(self.layout, f"{role.value}_axis")

    axis.__doc__ = f"The mesh axis of the {role} role, or None."
    return property(axis)


@dataclass(frozen=True, eq=False)
class BoundLayout:
    """A layout's names given mesh axes (:meth:`Layout.bind`): the one value a Trainer keeps
    (``trainer.layout``) and every part of its step asks which axes are which.

    Attributes:
        layout: the :class:`Layout` bound.
        mesh: its mesh: built from the layout's degrees, or the mesh given, its axes Auto.
        data_axes: the axes the gradients are averaged over (replicas, shards, context), in
            that order; ``("data",)`` for a layout that names none.
        split: how the batch reaches each device (:class:`BatchSplit`).
        binding: what model code's roles and logical axes stand for on this mesh, and the
            pipeline schedule (:class:`jaxcoll._core.roles.Binding`), put in force while a
            step is traced.
    """

    layout: Any  # the dp.Layout bound (its module imports this one)
    mesh: Mesh
    data_axes: tuple[str, ...]
    split: BatchSplit
    binding: roles.Binding

    # the data roles' axes the Trainer and the strategies ask for (the model's: ``axes``)
    shard_axis = _layout_axis(Role.SHARD)
    context_axis = _layout_axis(Role.CONTEXT)
    expert_axis = _layout_axis(Role.EXPERT)

    @property
    def axis_name(self) -> AxisName:
        """The data axes as collectives take them: the one axis, or the tuple of them."""
        return self.data_axes[0] if len(self.data_axes) == 1 else self.data_axes

    @property
    def n(self) -> int:
        """The number of parts the batch's examples are split into (the devices of the
        data axes but the context axis)."""
        return self.split.n

    @property
    def axes(self) -> tuple[str, ...]:
        """The model's axes: the tensor axis, then the pipeline axis (those that are set)."""
        return self.layout.axes

    @property
    def param_axes(self) -> tuple[str, ...]:
        """The axes a model spec may name: the model's axes and the expert axis."""
        return self.layout.param_axes

    @property
    def schedule(self) -> Any:
        """The pipeline's schedule, or None."""
        return self.layout.schedule

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a global batch goes: split along its leading axis over the data axes but
        the context axis, replicated over the others."""
        return NamedSharding(self.mesh, self.split.spec)

    def __repr__(self) -> str:
        return f"BoundLayout({self.layout!r}, mesh {dict(self.mesh.shape)})"

    def __str__(self) -> str:
        return str(self.layout)
