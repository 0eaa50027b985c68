"""Roles and logical axes: the names model code gives mesh axes, resolved by the layout in force.

Model code written once for every layout names no mesh axis. It names a *role*
(``"tensor"``, ``"pipeline"``) or a *logical axis* of a param (``"heads"``, ``"mlp"``,
``"vocab"``, ``"layers"``, ...), and a layout (:class:`jaxcoll.dp.Layout`) maps each to a mesh
axis, or to none (the model runs dense over it). While a ``dp.Trainer`` traces its step, its
layout's :class:`Binding` is in force here; :func:`axis` reads it. Outside one, a name is
itself (a mesh axis name, as model code wrote before layouts).

This module is the ground floor both sides meet on: ``jaxcoll.nn``'s layers and
``jaxcoll.parallel``'s pipeline read a binding, ``jaxcoll.dp`` writes one.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class Role(str, enum.Enum):
    """The roles a layout gives mesh axes: the one spelling of each role's name.

    A member is its name as a string (``Role.TENSOR == "tensor"``), so model code may write
    either; jaxcoll's own code writes the member. A mesh a :class:`jaxcoll.dp.Layout` builds
    from degrees names each axis after its role. Words: an *axis* is a mesh axis (passed as
    ``axis_name``), a *dim* a tensor dimension.
    """

    REPLICATE = "replicate"  # data replicas (DDP, HSDP's outer axis)
    SHARD = "shard"  # data shards (FSDP, ZeRO-1, HSDP's inner axis)
    CONTEXT = "context"  # the sequence split (context parallel)
    TENSOR = "tensor"  # tensor parallel
    PIPELINE = "pipeline"  # pipeline stages
    EXPERT = "expert"  # a mixture's experts (over the data shards' devices they borrow)

    def __str__(self) -> str:
        return self.value


#: The roles that split the batch's examples.
DATA_ROLES = (Role.REPLICATE, Role.SHARD)

#: The roles a layout gives mesh axes, besides the data axes (``replicate``, ``shard``).
MODEL_ROLES = (Role.TENSOR, Role.PIPELINE)

#: The logical axes model code may name, each with its default role (None: never split).
#: A layout's ``rules`` override or extend it (MaxText's ``logical_axis_rules``).
LOGICAL_AXES: Mapping[str, Role | None] = {
    "heads": Role.TENSOR,  # attention heads (q, k, v, and the output projection's input)
    "kv_heads": Role.TENSOR,
    "mlp": Role.TENSOR,  # an MLP's hidden units
    "vocab": Role.TENSOR,  # the embedding's / head's vocabulary
    "embed": None,  # the model width
    "kv": None,  # a head's width
    "length": None,  # the sequence
    "layers": Role.PIPELINE,  # blocks stacked on a leading axis
    "experts": Role.EXPERT,  # a mixture's experts (over the data-shard devices they borrow)
}

#: The pipeline schedule classes by their short names (``"1f1b"``: ``OneFOneB``), as a
#: layout's name spells them (``"pp4:1f1b8"``). :mod:`jaxcoll.parallel.schedules` defines the
#: classes and fills this table; :meth:`jaxcoll.dp.Layout.parse` reads it (dp may not import
#: parallel: both meet here, on the ground floor).
SCHEDULES: dict[str, type] = {}

#: The context role's attention methods by name (``"ring"``: ``Ring``), filled by
#: :mod:`jaxcoll.parallel.context`; :class:`jaxcoll.dp.Layout` checks its ``attention`` with it.
CONTEXT_METHODS: dict[str, type] = {}


@dataclass(frozen=True)
class Binding:
    """Names resolved to mesh axes (``None``: the name has no axis here, run dense), the
    pipeline schedule and the context role's attention method, as a layout binds them over
    one mesh."""

    axes: Mapping[str, str | None] = field(default_factory=dict)
    schedule: Any = None
    context_method: Any = None


#: Context managers ``cm(binding)`` a Trainer enters while it traces its step under a
#: binding: a floor above fills it (:mod:`jaxcoll.parallel.context` routes
#: ``jax.nn.dot_product_attention`` through the context role's attention).
ON_TRACE: list[Callable[[Binding], contextlib.AbstractContextManager]] = []


class ManualRole(Exception):
    """Raised by :func:`axis`, while :func:`probing` a role, when model code asks for that
    role's axis: the model runs the role's collectives itself."""

    def __init__(self, role: Role) -> None:
        super().__init__(f"model code asked for the {role} axis")
        self.role = role


_ACTIVE: contextvars.ContextVar[Binding | None] = contextvars.ContextVar(
    "jaxcoll_layout_binding", default=None
)
# The roles model code asked for while a step was traced (a set, or None: not recording).
_USED: contextvars.ContextVar[set | None] = contextvars.ContextVar("jaxcoll_used", default=None)
# The role whose first request raises ManualRole (a probe), or None.
_PROBE: contextvars.ContextVar[Role | None] = contextvars.ContextVar("jaxcoll_probe", default=None)


def active() -> Binding | None:
    """The binding in force (a Trainer tracing its step), or None."""
    return _ACTIVE.get()


def axis(name: Hashable | None) -> Any:
    """The mesh axis that ``name`` (a role, a logical axis or a mesh axis) stands for where
    this is called: the binding's axis for it (None where the layout gives it none), else
    ``name`` itself (a :class:`Role` as its plain string: ``"tensor"``, as a mesh names it)."""
    binding = _ACTIVE.get()
    if binding is None or not isinstance(name, str) or name not in binding.axes:
        return name.value if isinstance(name, Role) else name
    _note(name, binding.axes[name])
    return binding.axes[name]


def _note(name: str, mesh_axis: str | None) -> None:
    """Record that model code asked for the role ``name`` (or a logical axis of it) stands for,
    and raise :class:`ManualRole` where that role is probed."""
    role = _role_of(name)
    if role is None or mesh_axis is None:
        return
    if _PROBE.get() == role:
        raise ManualRole(role)
    used = _USED.get()
    if used is not None:
        used.add(role)


def _role_of(name: str) -> Role | None:
    try:
        return Role(name)
    except ValueError:
        return LOGICAL_AXES.get(name)


def context_method() -> Any:
    """The context role's attention method of the binding in force (``parallel.Ring()`` or
    ``parallel.Ulysses()``), or None."""
    binding = _ACTIVE.get()
    return None if binding is None else binding.context_method


@contextlib.contextmanager
def recording() -> Iterator[set]:
    """Record, for the block, the roles model code asks :func:`axis` for (the set yielded):
    a Trainer refuses a layout role its model never used."""
    used: set = set()
    token = _USED.set(used)
    try:
        yield used
    finally:
        _USED.reset(token)


@contextlib.contextmanager
def probing(role: Role) -> Iterator[None]:
    """For the block, the first request for ``role``'s axis raises :class:`ManualRole`."""
    token = _PROBE.set(role)
    try:
        yield
    finally:
        _PROBE.reset(token)


def schedule() -> Any:
    """The pipeline schedule of the binding in force, or None."""
    binding = _ACTIVE.get()
    return None if binding is None else binding.schedule


@contextlib.contextmanager
def bound(binding: Binding | None) -> Iterator[None]:
    """Put ``binding`` in force for the block (None: leave the one in force)."""
    if binding is None:
        yield
        return
    token = _ACTIVE.set(binding)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
