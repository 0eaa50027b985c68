"""dp.Layout: every role of the mesh in one value (data replicas, data shards, context,
tensor, pipeline, and the experts that borrow the data shards).

A :class:`~jaxcoll.dp.Trainer` takes one layout. It builds the mesh from degrees (or names
the axes of a mesh it is given), tells the Trainer which axes the batch splits over (the data
axes) and which the *model* splits (tensor, pipeline), picks the default strategy, and binds
the names model code uses (roles, logical axes: :mod:`jaxcoll._core.roles`) to mesh axes.
Each param carries a *model spec*, a ``PartitionSpec`` over the model axes only
(``P(None, "tensor")`` for a column-parallel kernel, ``P("pipeline", ...)`` for layers stacked
by stage); the strategy splits each leaf further over the data axes along a dimension the
model spec leaves whole (FSDP), so a TP-split kernel stays split over ``tensor`` and FSDP
splits it over the shard axis too.

This module holds the value; the spec arithmetic under it (where the model specs come from,
how a data split merges into one, the checks) is :mod:`jaxcoll.dp.specs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from .._core import roles


def _is_spec(x: Any) -> bool:
    return isinstance(x, P) or x is None


ROLES = ("replicate", "shard", "context", "tensor", "pipeline")
# A mesh built from degrees: its axes in this order, outermost first (torchtitan's): pipeline
# stages across hosts (little traffic), tensor innermost (the most, on the closest devices).
_ORDER = ("pipeline", "replicate", "shard", "context", "tensor")
_DATA = ("replicate", "shard")


def _role_value(name: str, value: Any) -> None:
    ok = value is None or isinstance(value, (int, str)) and not isinstance(value, bool)
    if name == "replicate" and isinstance(value, tuple):
        ok = all(isinstance(a, str) for a in value) and len(value) > 0
    if not ok:
        raise TypeError(
            f"dp.Layout: {name} must be a degree (an int: the layout builds the mesh) or the "
            f"name of a mesh axis (a string: the axis of the mesh you pass), got {value!r} of "
            f"type {type(value).__name__} instead."
        )
    if isinstance(value, int) and value != -1 and value < 1:
        raise ValueError(
            f"dp.Layout: {name}={value} must be a positive degree, or -1 for the devices "
            f"the other roles leave."
        )


def _role_axis(role: str) -> Any:
    """The property of a layout that is the mesh axis of ``role``, or None."""

    def axis(self: Layout) -> str | None:
        return next(iter(self._names(role)), None)

    axis.__doc__ = f"The mesh axis of the {role} role, or None."
    return property(axis)


@dataclass(frozen=True, repr=False)
class Layout:
    """Every role of the mesh in one value: data replicas, data shards, tensor, pipeline.

    Give **degrees** and the layout builds the mesh (``trainer.mesh``), or give the
    **names** of a mesh's axes and pass that mesh (``Trainer(..., mesh=m)``)::

        Layout(shard=4, tensor=2)                    # FSDP over 4 x tensor parallel over 2
        Layout(replicate=2, shard=4)                 # HSDP: 2 replicas of FSDP over 4
        Layout(replicate=2, tensor=2, pipeline=2, schedule=parallel.OneFOneB(8))
        Layout(shard="data", tensor="model")         # roles of your own mesh's axes
        Layout(shard=2, context=4)                   # FSDP x a sequence split over 4

    A mesh built from degrees has the axes ``("pipeline", "replicate", "shard", "context",
    "tensor")``
    (those with a degree above 1; a data axis ``"replicate"`` always), outermost first:
    tensor parallel on the closest devices, pipeline stages across hosts. A degree of -1 takes
    the devices the others leave; with no data role, ``replicate`` does.

    The Trainer takes the layout once. The batch is split over the data axes
    (``replicate`` and ``shard``); the strategy (``sync=``) says *how* they hold the state
    and defaults from the layout: :class:`~jaxcoll.dp.sync.FSDP` over ``shard`` (HSDP with
    ``replicate`` too), :class:`~jaxcoll.dp.sync.DDP` without one;
    ``sync=dp.sync.ZeRO1()`` splits the optimizer state over ``shard`` alone. Over the model's
    axes (tensor, pipeline) the batch is replicated, each param arrives as this device's slice
    of its *model spec*, and the model's own collectives (a row-parallel layer's all-reduce,
    a pipeline's sends) do the rest; jax differentiates them, so a param replicated over the
    tensor axis gets the gradient summed over it (Megatron's "f" operator) and a split one its
    own slice's; the strategy then synchronises each over the data axes only, once. The loss
    (and every metric) must be the same on every device of the model's axes; a loss that
    varies over them is refused when the step is traced.

    **Model code names no mesh axis.** It names roles (``jaxcoll.nn``'s layers split over
    ``"tensor"`` by default; :func:`~jaxcoll.parallel.pipeline_loss` runs over ``"pipeline"``
    with the layout's ``schedule``) and logical axes in its param boxes
    (``nn.with_partitioning(init, ("layers", None))``: ``heads``, ``kv_heads``, ``mlp``,
    ``vocab`` split over tensor; ``layers`` over pipeline; ``embed``, ``kv``, ``length``
    whole). While the Trainer traces its step, each resolves to this layout's axis for it,
    or to none (the model runs dense over it); ``rules`` maps more logical axes to roles (or
    overrides these: ``rules={"vocab": None}`` keeps the vocabulary whole).

    Args:
        replicate: data replicas (DDP, and HSDP's outer axis): a degree, or the name (or a
            tuple of names) of mesh axes.
        shard: data shards (FSDP, ZeRO-1, HSDP's inner axis): a degree or an axis name.
        tensor: tensor parallel: a degree or an axis name.
        pipeline: pipeline stages: a degree or an axis name.
        context: context parallel (long sequences): a degree or an axis name. Each
            sequence of the batch is split over it in the load-balanced layout
            (:func:`~jaxcoll.parallel.context_order`): every array of the batch with a
            sequence axis (its second) arrives as this device's part of it, attention runs
            over the whole sequence by :func:`~jaxcoll.parallel.context_attention` (the role
            ``"context"``; :class:`~jaxcoll.nn.ParallelSelfAttention` does it), position
            embeddings read :func:`~jaxcoll.parallel.context_positions`. The gradients and
            the metrics are averaged over it as over a data axis (each device's loss is its
            own tokens' mean).
        schedule: the pipeline's schedule (:class:`~jaxcoll.parallel.OneFOneB` (M),
            :class:`~jaxcoll.parallel.GPipe`, :class:`~jaxcoll.parallel.Interleaved`,
            :class:`~jaxcoll.parallel.ZeroBubble`), read by ``parallel.pipeline_loss``.
        rules: logical axis -> role (``"tensor"``, ``"pipeline"`` or None), on top of the
            defaults.

    Example (8 devices, FSDP over 4 x tensor parallel over 2)::

        >>> trainer = dp.Trainer(model, optax.adamw(1e-3), layout=dp.Layout(shard=4, tensor=2))
        >>> state = trainer.init(variables["params"], rng)   # boxed by nn.with_partitioning
    """

    replicate: int | str | tuple[str, ...] | None = None
    shard: int | str | None = None
    tensor: int | str | None = None
    pipeline: int | str | None = None
    schedule: Any = None
    rules: Any = None
    context: int | str | None = None
    expert: int | str | None = None

    def __post_init__(self) -> None:
        values = {r: getattr(self, r) for r in ROLES}
        for name, value in values.items():
            _role_value(name, value)
        _role_value("expert", self.expert)
        kinds = {isinstance(v, int) for v in (*values.values(), self.expert) if v is not None}
        if len(kinds) > 1:
            raise ValueError(
                f"dp.Layout: {self._shown()} mixes degrees (ints) and mesh axis names "
                f"(strings); give every role a degree (the layout builds the mesh) or every "
                f"role an axis of the mesh you pass."
            )
        if sum(v == -1 for v in values.values()) > 1:
            raise ValueError(
                f"dp.Layout: {self._shown()} gives -1 (the devices left) to more than one role."
            )
        names = [a for r in ROLES for a in self._names(r)]
        if len(set(names)) != len(names):
            raise ValueError(
                f"dp.Layout: {self._shown()} names one mesh axis for two roles; give each "
                f"role its own axis."
            )
        self._check_expert()
        if self.schedule is not None and not hasattr(self.schedule, "bubble_fraction"):
            raise TypeError(
                f"dp.Layout: schedule must be a pipeline schedule value (parallel.GPipe(M), "
                f"parallel.OneFOneB(M), parallel.Interleaved(M, virtual=v), "
                f"parallel.ZeroBubble(M)), got {self.schedule!r}."
            )
        if self.schedule is not None and self.pipeline is None:
            raise ValueError(
                f"dp.Layout: schedule={self.schedule!r} schedules a pipeline, and "
                f"{self._shown()} has none; give it pipeline= (the stages' degree or axis)."
            )
        rules = dict(self.rules or {})
        for key, role in rules.items():
            if not isinstance(key, str) or role not in roles.MODEL_ROLES + ("expert", None):
                raise ValueError(
                    f"dp.Layout: rules[{key!r}] = {role!r}; rules map a logical axis (a "
                    f"string) to a role: one of {roles.MODEL_ROLES + ('expert',)} or None "
                    f"(kept whole)."
                )
        object.__setattr__(self, "rules", tuple(sorted(rules.items())))

    def _check_expert(self) -> None:
        """The expert role borrows a data role's devices: the shards' (the replicas' where
        there are no shards), at that role's degree."""
        e = self.expert
        if e is None:
            return
        lender = "shard" if self.shard not in (None, 1) else "replicate"
        if isinstance(e, int):
            given = getattr(self, lender)
            if (
                e == -1
                or (isinstance(given, int) and given not in (-1, e))
                or (given is None and lender == "shard")
            ):
                raise ValueError(
                    f"dp.Layout: {self._shown()}: the expert role borrows the devices of "
                    f"the data shards (or of the replicas, without shards), so its degree "
                    f"is theirs; give expert={given!r}, or shard=<experts' degree> with "
                    f"replicate= the rest (Layout(replicate=2, shard=4, expert=4))."
                )
        elif isinstance(e, tuple) or e not in self._names("shard") + self._names("replicate"):
            raise ValueError(
                f"dp.Layout: {self._shown()}: expert={e!r} must name the axis of the data "
                f"shards (or of the replicas, without shards): the experts borrow its "
                f"devices, each holding its own experts and its own tokens."
            )

    def _shown(self) -> str:
        roles_ = (*ROLES, "expert")
        given = [f"{r}={getattr(self, r)!r}" for r in roles_ if getattr(self, r) is not None]
        return "Layout(" + ", ".join(given) + ")"

    def __repr__(self) -> str:
        extra = [f"schedule={self.schedule!r}"] * (self.schedule is not None)
        extra += [f"rules={dict(self.rules)!r}"] * bool(self.rules)
        shown = self._shown()
        return shown[:-1] + ", " * (shown != "Layout()" and bool(extra)) + ", ".join(extra) + ")"

    @property
    def by_degree(self) -> bool:
        """True when the roles are degrees (the layout builds its mesh)."""
        return any(isinstance(getattr(self, r), int) for r in (*ROLES, "expert"))

    def _names(self, role: str) -> tuple[str, ...]:
        if role == "expert" and self.expert is not None and self.by_degree:
            degrees = self._degrees()
            return ("shard",) if "shard" in degrees else ("replicate",)
        if self.by_degree:
            return (role,) if role in self._degrees() else ()
        value = getattr(self, role)
        if value is None:
            return ()
        return value if isinstance(value, tuple) else (value,)

    def _degrees(self) -> dict[str, int]:
        """Role -> degree (``-1`` still unresolved) of the axes a built mesh has."""
        out = {r: getattr(self, r) for r in ROLES if isinstance(getattr(self, r), int)}
        out = {r: d for r, d in out.items() if d != 1 or r in _DATA}
        if not any(r in out for r in _DATA):
            out["replicate"] = -1
        if "shard" in out and out.get("replicate") == 1:
            del out["replicate"]
        if "replicate" in out and out.get("shard") == 1:
            del out["shard"]
        return out

    tensor_axis = _role_axis("tensor")
    pipeline_axis = _role_axis("pipeline")
    shard_axis = _role_axis("shard")
    context_axis = _role_axis("context")
    expert_axis = _role_axis("expert")

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the gradients are averaged over: the replicas, the shards and the
        context axis (those it names); () if it names none."""
        return self._names("replicate") + self._names("shard") + self._names("context")

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The data axes the batch's examples are split over (replicas, then shards)."""
        return self._names("replicate") + self._names("shard")

    @property
    def axes(self) -> tuple[str, ...]:
        """The model's axes: the tensor axis, then the pipeline axis (those that are set)."""
        return self._names("tensor") + self._names("pipeline")

    @property
    def param_axes(self) -> tuple[str, ...]:
        """The axes a model spec may name: the model's axes and the expert axis (a data
        axis the experts are split over)."""
        return self.axes + self._names("expert")

    def make_mesh(self, devices: Any = None) -> Mesh:
        """The mesh of a layout given by degrees, over ``devices`` (default: all), its axes
        Auto (the Trainer places its arrays itself)."""
        if not self.by_degree:
            raise ValueError(
                f"dp.Layout.make_mesh: {self._shown()} names the axes of a mesh you have; "
                f"pass that mesh (Trainer(..., mesh=m)), or give degrees to build one."
            )
        devices = np.asarray(jax.devices() if devices is None else devices).reshape(-1)
        degrees = self._degrees()
        known = int(np.prod([d for d in degrees.values() if d != -1]))
        n = devices.size
        if n % known:
            raise ValueError(
                f"dp.Layout: {self._shown()} needs a multiple of {known} devices, and there "
                f"are {n}; pick degrees whose product divides {n}."
            )
        degrees = {r: (n // known if d == -1 else d) for r, d in degrees.items()}
        total = int(np.prod(list(degrees.values())))
        if total != n:
            raise ValueError(
                f"dp.Layout: {self._shown()} uses {total} devices, and there are {n}; give "
                f"degrees whose product is {n}, or -1 for one role (the devices left)."
            )
        names = tuple(r for r in _ORDER if r in degrees)
        shape = tuple(degrees[r] for r in names)
        return Mesh(devices.reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))

    def binding(self) -> roles.Binding:
        """What model code's roles and logical axes stand for in this layout, and its
        schedule (:mod:`jaxcoll._core.roles`)."""
        by_role = {
            "tensor": self.tensor_axis,
            "pipeline": self.pipeline_axis,
            "context": self.context_axis,
            "expert": self.expert_axis,
        }
        table = {**roles.LOGICAL_AXES, **dict(self.rules)}
        axes: dict[str, Any] = dict(by_role)
        for logical, role in table.items():
            axes[logical] = None if role is None else by_role[role]
        axes["batch"] = self.data_axes or None  # the axes the tokens are split over
        return roles.Binding(axes, self.schedule)

    def check(self, api: str, mesh: Mesh, data_axes: tuple) -> None:
        """Raise ValueError if an axis of the layout is not an axis of ``mesh``, a model
        axis is also a data axis, or the expert axis is none (or its size not the expert
        degree)."""
        e = self.expert_axis
        if e is not None and (e not in data_axes or e not in mesh.axis_names):
            raise ValueError(
                f"{api}: layout expert={e!r} is not one of the data axes {data_axes}; the "
                f"experts borrow the devices of the data shards (or replicas): name that axis."
            )
        if e is not None and isinstance(self.expert, int) and mesh.shape[e] != self.expert:
            raise ValueError(
                f"{api}: layout expert={self.expert} borrows the {e!r} axis, of size "
                f"{mesh.shape[e]}; give expert={mesh.shape[e]} (the experts' degree is that "
                f"axis's)."
            )
        for role in ROLES:
            for axis in self._names(role):
                if axis not in mesh.axis_names:
                    raise ValueError(
                        f"{api}: layout {role}={axis!r} is not an axis of the mesh (axes "
                        f"{mesh.axis_names}). Pass one of them, or a mesh with that axis."
                    )
                if role in roles.MODEL_ROLES and axis in data_axes:
                    raise ValueError(
                        f"{api}: layout {role}={axis!r} is also a data axis (axis_name="
                        f"{data_axes!r}); an axis has one role. Split the batch over the other "
                        f"axes or give the {role} role another axis."
                    )
