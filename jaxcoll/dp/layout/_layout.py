"""dp.Layout: every role of the mesh in one value (data replicas, data shards, context,
tensor, pipeline, and the experts that borrow the data shards' devices), its short name, and
the layout bound to one mesh (:class:`BoundLayout`), which a Trainer keeps whole.

A :class:`~jaxcoll.dp.Trainer` takes one layout and binds it once (:meth:`Layout.bind`): the
mesh built from degrees (or the mesh it is given, whose axes the layout names), the data axes
the batch splits over and the gradients are averaged over, how the batch reaches each device
(:class:`BatchSplit`), and what the names model code uses (roles, logical axes:
:mod:`jaxcoll._core.roles`) stand for on that mesh. Each param carries a *model spec*, a
``PartitionSpec`` over the model axes only (``P(None, "tensor")`` for a column-parallel
kernel, ``P("pipeline", ...)`` for layers stacked by stage); the strategy splits each leaf
further over the data axes along a dimension the model spec leaves whole (FSDP), so a
TP-split kernel stays split over ``tensor`` and FSDP splits it over the shard axis too.

A layout given by degrees prints and parses its short name (:meth:`Layout.parse`,
:attr:`Layout.name`): ``"dp2xfsdp4xtp2"``, ``"fsdp2xtp2xpp2:1f1b8"``, ``"single"``.

This module holds the values; the spec arithmetic under them (where the model specs come
from, how a data split merges into one, the checks) is :mod:`jaxcoll.dp.specs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from ..._core import roles
from ..._core.roles import Role
from . import _bound, _grammar
from ._bound import BoundLayout


def is_spec(x: Any) -> bool:
    """A PartitionSpec or None (a whole leaf): a leaf of a specs tree."""
    return isinstance(x, P) or x is None


#: Every role a layout gives: five own mesh axes; the experts borrow the data shards' axis
#: (the replicas' without shards).
ROLES = (Role.REPLICATE, Role.SHARD, Role.CONTEXT, Role.TENSOR, Role.PIPELINE, Role.EXPERT)
_AXIS_ROLES = ROLES[:5]  # the roles with mesh axes of their own
# A mesh built from degrees: its axes in this order, outermost first (torchtitan's): pipeline
# stages across hosts (little traffic), tensor innermost (the most, on the closest devices).
_ORDER = (Role.PIPELINE, Role.REPLICATE, Role.SHARD, Role.CONTEXT, Role.TENSOR)
_DATA = roles.DATA_ROLES

#: The data axis of a layout that names none: every device on one axis of this name.


def _role_value(role: Role, value: Any) -> None:
    ok = value is None or isinstance(value, (int, str)) and not isinstance(value, bool)
    if role in _DATA and isinstance(value, tuple):
        ok = all(isinstance(a, str) for a in value) and len(value) > 0
    if not ok:
        raise TypeError(
            f"dp.Layout: {role} must be a degree (an int: the layout builds the mesh) or the "
            f"name of a mesh axis (a string: the axis of the mesh you pass), got {value!r} of "
            f"type {type(value).__name__} instead."
        )
    if isinstance(value, int) and value != -1 and value < 1:
        raise ValueError(
            f"dp.Layout: {role}={value} must be a positive degree, or -1 for the devices "
            f"the other roles leave."
        )


def _role_axis(role: Role) -> Any:
    """The property of a layout that is the mesh axis of ``role``, or None."""

    def axis(self: Layout) -> Any:
        names = self._names(role)
        return None if not names else names[0] if len(names) == 1 else names

    axis.__doc__ = f"The mesh axis of the {role} role (a tuple of axes for several), or None."
    return property(axis)


@dataclass(frozen=True, repr=False)
class Layout:
    """Every role of the mesh in one value: data replicas, data shards, context, tensor,
    pipeline, experts.

    Give **degrees** and the layout builds the mesh (``trainer.mesh``), or give the
    **names** of a mesh's axes and pass that mesh (``Trainer(..., mesh=m)``)::

        Layout(shard=4, tensor=2)                    # FSDP over 4 x tensor parallel over 2
        Layout(replicate=2, shard=4)                 # HSDP: 2 replicas of FSDP over 4
        Layout(replicate=2, tensor=2, pipeline=2, schedule=parallel.OneFOneB(8))
        Layout(shard="data", tensor="model")         # roles of your own mesh's axes
        Layout(shard=2, context=4)                   # FSDP x a sequence split over 4
        Layout.parse("dp2xtp2xpp2:1f1b8")            # the third one, by its short name

    A mesh built from degrees has the axes ``("pipeline", "replicate", "shard", "context",
    "tensor")``
    (those with a degree above 1; a data axis ``"replicate"`` always), outermost first:
    tensor parallel on the closest devices, pipeline stages across hosts. A degree of -1 takes
    the devices the others leave; with no data role, ``replicate`` does. A layout whose
    degrees are all 1 (``Layout(replicate=1)``, named ``"single"``) runs on one device, the
    first. A layout that names no data axis (``Layout()``, the Trainer's default) splits the
    batch over an axis ``"data"``: every device of a mesh it builds, or the axis of that name
    of the mesh you pass.

    **Its name.** A layout given by degrees has a short name (:attr:`name`, ``str(layout)``)
    that :meth:`parse` reads back: its roles joined by ``x``, each ``dp`` (replicate),
    ``fsdp`` (shard), ``cp`` (context), ``tp`` (tensor), ``pp`` (pipeline) or ``ep`` (expert)
    and its degree, then optionally ``:`` and the schedule's short name and micro-batches
    (``gpipe4``, ``1f1b8``, ``interleaved8v2`` (v: model chunks per stage), ``zb8``):
    ``"dp2xfsdp4xtp2"``, ``"fsdp2xtp2xpp2:1f1b8"``, ``"pp4:interleaved8v2"``. The strategy
    is no part of it: ``"fsdp4xtp2"`` with ``sync=dp.sync.ZeRO1()`` splits only the optimizer
    state over the shards.

    The Trainer binds the layout once (:meth:`bind`: :class:`BoundLayout`). The batch is
    split over the data axes (``replicate`` and ``shard``); the strategy (``sync=``) says
    *how* they hold the state and defaults from the layout: :class:`~jaxcoll.dp.sync.FSDP`
    over ``shard`` (HSDP with ``replicate`` too), :class:`~jaxcoll.dp.sync.DDP` without one;
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
    ``vocab`` split over tensor; ``layers`` over pipeline; ``experts`` over the expert axis;
    ``embed``, ``kv``, ``length`` whole). While the Trainer traces its step, each resolves
    to this layout's axis for it, or to none (the model runs dense over it); ``rules`` maps
    more logical axes to roles (or overrides these: ``rules={"vocab": None}`` keeps the
    vocabulary whole).

    Args:
        replicate: data replicas (DDP, and HSDP's outer axis): a degree, or the name (or a
            tuple of names) of mesh axes.
        shard: data shards (FSDP, ZeRO-1, HSDP's inner axis): a degree, or the name (or a
            tuple of names: the state split over their product) of mesh axes.
        tensor: tensor parallel: a degree or an axis name.
        pipeline: pipeline stages: a degree or an axis name.
        schedule: the pipeline's schedule (:class:`~jaxcoll.parallel.OneFOneB` (M),
            :class:`~jaxcoll.parallel.GPipe`, :class:`~jaxcoll.parallel.Interleaved`,
            :class:`~jaxcoll.parallel.ZeroBubble`), read by ``parallel.pipeline_loss``.
        rules: logical axis -> role (``"tensor"``, ``"pipeline"``, ``"expert"`` or None), on
            top of the defaults.
        context: context parallel (long sequences): a degree or an axis name. Each
            sequence of the batch is split over it in the load-balanced layout
            (:func:`~jaxcoll.parallel.context_order`): every array of the batch with a
            sequence axis (its second) arrives as this device's part of it, attention runs
            over the whole sequence by :func:`~jaxcoll.parallel.context_attention` (the role
            ``"context"``; :class:`~jaxcoll.nn.ParallelSelfAttention` does it), position
            embeddings read :func:`~jaxcoll.parallel.context_positions`. The gradients and
            the metrics are averaged over it as over a data axis (each device's loss is its
            own tokens' mean).
        expert: expert parallel (a mixture of experts, the logical axis ``experts``): a
            degree or an axis name. The experts reuse the devices of the data shards (of the
            replicas, without shards): each device holds its own experts and routes its own
            tokens to the others' (an all-to-all over that axis). So its degree is the
            shards' (``Layout(replicate=2, shard=4, expert=4)``), and with names it is the
            shards' axis (``Layout(shard="data", expert="data")``).
        attention: the context role's attention: ``parallel.Ring()`` (the default) or
            ``parallel.Ulysses()``. Model code computing attention with
            ``jax.nn.dot_product_attention`` or :func:`~jaxcoll.parallel.context_attention`
            gets it; a model that computes attention any other way under a context role is
            refused when the step is traced (it would attend within each device's part).

    Example (8 devices, FSDP over 4 x tensor parallel over 2)::

        >>> trainer = dp.Trainer(model, optax.adamw(1e-3), layout=dp.Layout(shard=4, tensor=2))
        >>> state = trainer.init(variables["params"], rng)   # boxed by nn.with_partitioning
        >>> str(trainer.layout), dp.Layout.parse("fsdp4xtp2") == dp.Layout(shard=4, tensor=2)
        ('fsdp4xtp2', True)
    """

    replicate: int | str | tuple[str, ...] | None = None
    shard: int | str | tuple[str, ...] | None = None
    tensor: int | str | None = None
    pipeline: int | str | None = None
    schedule: Any = None
    rules: Any = None
    context: int | str | None = None
    expert: int | str | None = None
    attention: Any = None

    def __post_init__(self) -> None:
        values = {r: getattr(self, r) for r in ROLES}
        for role, value in values.items():
            _role_value(role, value)
        if len({isinstance(v, int) for v in values.values() if v is not None}) > 1:
            raise ValueError(
                f"dp.Layout: {self._shown()} mixes degrees (ints) and mesh axis names "
                f"(strings); give every role a degree (the layout builds the mesh) or every "
                f"role an axis of the mesh you pass."
            )
        if sum(values[r] == -1 for r in _AXIS_ROLES) > 1:
            raise ValueError(
                f"dp.Layout: {self._shown()} gives -1 (the devices left) to more than one role."
            )
        names = [a for r in _AXIS_ROLES for a in self._names(r)]
        if len(set(names)) != len(names):
            raise ValueError(
                f"dp.Layout: {self._shown()} names one mesh axis for two roles; give each "
                f"role its own axis."
            )
        self._check_expert()
        self._check_schedule()
        self._check_attention()
        rules = dict(self.rules or {})
        allowed = (*roles.MODEL_ROLES, Role.EXPERT)
        for key, role in rules.items():
            if not isinstance(key, str) or (role is not None and role not in allowed):
                raise ValueError(
                    f"dp.Layout: rules[{key!r}] = {role!r}; rules map a logical axis (a "
                    f"string) to a role: one of {[r.value for r in allowed]} or None (kept "
                    f"whole)."
                )
        object.__setattr__(self, "rules", tuple(sorted(rules.items())))

    def _check_schedule(self) -> None:
        self._check_option(
            "schedule",
            hasattr(self.schedule, "bubble_fraction"),
            "a pipeline schedule value (parallel.GPipe(M), parallel.OneFOneB(M), "
            "parallel.Interleaved(M, virtual=v), parallel.ZeroBubble(M))",
            Role.PIPELINE,
            "the stages' degree or axis",
        )

    def _check_attention(self) -> None:
        methods = tuple(roles.CONTEXT_METHODS.values())
        self._check_option(
            "attention",
            not methods or isinstance(self.attention, methods),
            "parallel.Ring() or parallel.Ulysses()",
            Role.CONTEXT,
            "a degree or an axis",
        )

    def _check_option(self, arg: str, valid: bool, kinds: str, role: Role, fix: str) -> None:
        """An option of one role (the pipeline's schedule, the context's attention): None, or
        a value of its kinds given beside that role."""
        value = getattr(self, arg)
        if value is None:
            return
        if not valid:
            raise TypeError(f"dp.Layout: {arg} must be {kinds}, got {value!r}.")
        if getattr(self, role.value) is None:
            raise ValueError(
                f"dp.Layout: {arg}={value!r} is the {role.value} role's, and {self._shown()} "
                f"has none; give it {role.value}= ({fix})."
            )

    def _check_expert(self) -> None:
        """The expert role borrows a data role's devices: the shards' (the replicas' where
        there are no shards), at that role's degree."""
        e = self.expert
        if e is None:
            return
        lender = Role.SHARD if self.shard not in (None, 1) else Role.REPLICATE
        if isinstance(e, int):
            given = getattr(self, lender)
            if (
                e == -1
                or (isinstance(given, int) and given not in (-1, e))
                or (given is None and lender == Role.SHARD)
            ):
                raise ValueError(
                    f"dp.Layout: {self._shown()}: the expert role borrows the devices of "
                    f"the data shards (or of the replicas, without shards), so its degree "
                    f"is theirs; give expert={given!r}, or shard=<experts' degree> with "
                    f"replicate= the rest (Layout(replicate=2, shard=4, expert=4))."
                )
        elif e not in self._names(Role.SHARD) + self._names(Role.REPLICATE):
            raise ValueError(
                f"dp.Layout: {self._shown()}: expert={e!r} must name the axis of the data "
                f"shards (or of the replicas, without shards): the experts borrow its "
                f"devices, each holding its own experts and its own tokens."
            )

    def _shown(self) -> str:
        given = [f"{r}={getattr(self, r)!r}" for r in ROLES if getattr(self, r) is not None]
        return "Layout(" + ", ".join(given) + ")"

    def __repr__(self) -> str:
        extra = [f"schedule={self.schedule!r}"] * (self.schedule is not None)
        extra += [f"rules={dict(self.rules)!r}"] * bool(self.rules)
        extra += [f"attention={self.attention!r}"] * (self.attention is not None)
        shown = self._shown()
        return shown[:-1] + ", " * (shown != "Layout()" and bool(extra)) + ", ".join(extra) + ")"

    # --------------------------------------------------------------------------- its name
    @property
    def name(self) -> str:
        """The layout's short name (``"fsdp2xtp2xpp2:1f1b8"``; ``"single"`` for
        ``Layout(replicate=1)``), which :meth:`parse` reads back.

        Raises:
            ValueError: the layout has no short name: it names mesh axes (a short name gives
                degrees), it has ``rules``, or its schedule has no short name.
        """
        name, why = _grammar.short_name(self)
        if not name:
            raise ValueError(
                f"dp.Layout.name: {self!r} has no short name: it {why}. Only a layout given "
                f"by degrees has one ({_grammar.GRAMMAR})."
            )
        return name

    def __str__(self) -> str:
        """Its short name (:attr:`name`), or its repr where it has none."""
        return _grammar.short_name(self)[0] or repr(self)

    @classmethod
    def parse(cls, name: str) -> Layout:
        """The layout a short name names: ``Layout.parse(str(layout)) == layout``.

        ``"dp2xfsdp4xtp2"`` is ``Layout(replicate=2, shard=4, tensor=2)``,
        ``"fsdp2xtp2xpp2:1f1b8"`` is ``Layout(shard=2, tensor=2, pipeline=2,
        schedule=parallel.OneFOneB(8))``, ``"pp4:interleaved8v2"`` has
        ``parallel.Interleaved(8, virtual=2)``, ``"single"`` is ``Layout(replicate=1)`` (one
        device). The grammar is :class:`Layout`'s: roles joined by ``x``, each ``dp``,
        ``fsdp``, ``cp``, ``tp``, ``pp`` or ``ep`` and its degree (-1: the devices left),
        then optionally ``:``, the schedule's short name and its micro-batches (the
        schedules are :mod:`jaxcoll.parallel`'s values: import it to parse one).

        Raises:
            ValueError: ``name`` is not in the grammar (the message names the bad part), or
                names a layout :class:`Layout` refuses.
            TypeError: ``name`` is not a string.
        """
        if not isinstance(name, str):
            raise TypeError(
                f"dp.Layout.parse: name must be a layout's short name (a string such as "
                f"'fsdp4xtp2'), got {name!r} of type {type(name).__name__} instead."
            )
        given = _grammar.parse(name)
        try:
            return cls(**given)
        except (TypeError, ValueError) as e:
            raise ValueError(f"dp.Layout.parse: {name!r} is no layout: {e}") from None

    # ---------------------------------------------------------------------------- its axes
    @property
    def by_degree(self) -> bool:
        """True when the roles are degrees (the layout builds its mesh)."""
        return any(isinstance(getattr(self, r), int) for r in ROLES)

    def _names(self, role: Role) -> tuple[str, ...]:
        if role == Role.EXPERT and self.expert is not None and self.by_degree:
            shard = Role.SHARD in self._degrees()
            return (Role.SHARD.value,) if shard else (Role.REPLICATE.value,)
        if self.by_degree:
            return (role.value,) if role in self._degrees() else ()
        value = getattr(self, role)
        if value is None:
            return ()
        return value if isinstance(value, tuple) else (value,)

    def _degrees(self) -> dict[Role, int]:
        """Role -> degree (``-1`` still unresolved) of the axes a built mesh has."""
        out = {r: getattr(self, r) for r in _AXIS_ROLES if isinstance(getattr(self, r), int)}
        out = {r: d for r, d in out.items() if d != 1 or r in _DATA}
        if not any(r in out for r in _DATA):
            out[Role.REPLICATE] = -1
        if Role.SHARD in out and out.get(Role.REPLICATE) == 1:
            del out[Role.REPLICATE]
        if Role.REPLICATE in out and out.get(Role.SHARD) == 1:
            del out[Role.SHARD]
        return out

    tensor_axis = _role_axis(Role.TENSOR)
    pipeline_axis = _role_axis(Role.PIPELINE)
    shard_axis = _role_axis(Role.SHARD)
    context_axis = _role_axis(Role.CONTEXT)
    expert_axis = _role_axis(Role.EXPERT)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the gradients are averaged over: the replicas, the shards and the
        context axis (those it names); () if it names none."""
        return self._names(Role.REPLICATE) + self._names(Role.SHARD) + self._names(Role.CONTEXT)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The data axes the batch's examples are split over (replicas, then shards)."""
        return self._names(Role.REPLICATE) + self._names(Role.SHARD)

    @property
    def axes(self) -> tuple[str, ...]:
        """The model's axes: the tensor axis, then the pipeline axis (those that are set)."""
        return self._names(Role.TENSOR) + self._names(Role.PIPELINE)

    @property
    def param_axes(self) -> tuple[str, ...]:
        """The axes a model spec may name: the model's axes and the expert axis (a data
        axis the experts are split over)."""
        return self.axes + self._names(Role.EXPERT)

    def make_mesh(self, devices: Any = None) -> Mesh:
        """The mesh of a layout given by degrees, over ``devices`` (default: all; the first
        alone where every degree is 1), its axes Auto (the Trainer places its arrays
        itself)."""
        if not self.by_degree:
            raise ValueError(
                f"dp.Layout.make_mesh: {self._shown()} names the axes of a mesh you have; "
                f"pass that mesh (Trainer(..., mesh=m)), or give degrees to build one."
            )
        devices = np.asarray(jax.devices() if devices is None else devices).reshape(-1)
        degrees = self._degrees()
        if all(d == 1 for d in degrees.values()):  # "single": one device
            devices = devices[:1]
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
        names = tuple(r.value for r in _ORDER if r in degrees)
        shape = tuple(degrees[r] for r in _ORDER if r in degrees)
        return Mesh(devices.reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))

    # ----------------------------------------------------------------------------- binding
    def bind(self, mesh: Mesh | None = None) -> BoundLayout:
        """This layout's names given mesh axes: the :class:`BoundLayout` a Trainer keeps.

        Args:
            mesh: for a layout that names mesh axes (or none), the mesh that has them
                (default: every device on one axis ``"data"``); its axes are made Auto
                (the same devices and names). None for a layout given by degrees: it builds
                its own (:meth:`make_mesh`).

        Raises:
            ValueError: a mesh beside degrees; an axis the layout names is not an axis of
                the mesh; a model axis is also a data axis; the expert axis is none of the
                data axes (or of another size than the expert degree).
        """
        return self._bind("dp.Layout.bind", mesh)

    def _bind(self, api: str, mesh: Mesh | None) -> BoundLayout:
        """:meth:`bind`, its errors naming ``api`` (the Trainer's)."""
        return _bound.bind(self, api, mesh)

    def _binding(self, data_axes: tuple[str, ...] | None = None) -> roles.Binding:
        """What model code's roles and logical axes stand for in this layout, and its
        schedule (:mod:`jaxcoll._core.roles`); ``data_axes``: the bound mesh's data axes
        (a layout that names none splits the batch over the mesh's ``"data"``)."""
        by_role = {
            r.value: getattr(self, f"{r.value}_axis")
            for r in (Role.TENSOR, Role.PIPELINE, Role.CONTEXT, Role.EXPERT)
        }
        table = {**roles.LOGICAL_AXES, **dict(self.rules)}
        axes: dict[str, Any] = dict(by_role)
        for logical, role in table.items():
            axes[logical] = None if role is None else by_role[role]
        tokens = self.data_axes if data_axes is None else data_axes
        axes["batch"] = tokens or None  # the axes the tokens are split over
        return roles.Binding(axes, self.schedule, self.attention)
