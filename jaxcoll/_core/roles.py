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
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The roles a layout gives mesh axes, besides the data axes (``replicate``, ``shard``).
MODEL_ROLES = ("tensor", "pipeline")

#: The logical axes model code may name, each with its default role (None: never split).
#: A layout's ``rules`` override or extend it (MaxText's ``logical_axis_rules``).
LOGICAL_AXES: Mapping[str, str | None] = {
    "heads": "tensor",  # attention heads (q, k, v, and the output projection's input)
    "kv_heads": "tensor",
    "mlp": "tensor",  # an MLP's hidden units
    "vocab": "tensor",  # the embedding's / head's vocabulary
    "embed": None,  # the model width
    "kv": None,  # a head's width
    "length": None,  # the sequence
    "layers": "pipeline",  # blocks stacked on a leading axis
    "experts": "expert",  # a mixture's experts (over the data-shard devices they borrow)
}


@dataclass(frozen=True)
class Binding:
    """Names resolved to mesh axes (``None``: the name has no axis here, run dense) and the
    pipeline schedule, as a layout binds them over one mesh."""

    axes: Mapping[str, str | None] = field(default_factory=dict)
    schedule: Any = None


_ACTIVE: contextvars.ContextVar[Binding | None] = contextvars.ContextVar(
    "jaxcoll_layout_binding", default=None
)


def active() -> Binding | None:
    """The binding in force (a Trainer tracing its step), or None."""
    return _ACTIVE.get()


def axis(name: Hashable | None) -> Any:
    """The mesh axis that ``name`` (a role, a logical axis or a mesh axis) stands for where
    this is called: the binding's axis for it (None where the layout gives it none), else
    ``name`` itself."""
    binding = _ACTIVE.get()
    if binding is None or not isinstance(name, str) or name not in binding.axes:
        return name
    return binding.axes[name]


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
