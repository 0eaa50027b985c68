"""A layout's short name: ``"dp2xfsdp4xtp2"``, ``"fsdp2xtp2xpp2:1f1b8"``, ``"single"``.

One grammar, printed by :attr:`~jaxcoll.dp.Layout.name` and read by
:meth:`~jaxcoll.dp.Layout.parse`: the roles joined by ``x``, each its abbreviation
(:data:`ABBREVIATIONS`) and its degree (-1: the devices the others leave), then optionally
``:`` and the pipeline schedule's short name and micro-batches (``1f1b8``; an interleaved
schedule's model chunks per stage after a ``v``: ``interleaved8v2``). The schedules' short
names are :data:`jaxcoll._core.roles.SCHEDULES`'s keys (:mod:`jaxcoll.parallel.schedules`
fills the table; dp may not import parallel). The strategy is no part of a layout's name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from ..._core import roles
from ..._core.roles import Role

#: Each role's abbreviation in a layout's short name, in the order the name lists them.
ABBREVIATIONS: Mapping[Role, str] = {
    Role.REPLICATE: "dp",
    Role.SHARD: "fsdp",
    Role.CONTEXT: "cp",
    Role.TENSOR: "tp",
    Role.PIPELINE: "pp",
    Role.EXPERT: "ep",
}
_BY_ABBREVIATION = {a: r for r, a in ABBREVIATIONS.items()}
#: The short name of the one-device layout, ``Layout(replicate=1)``.
SINGLE = "single"
GRAMMAR = (
    "a layout's name is its roles joined by 'x', each dp|fsdp|cp|tp|pp|ep (replicate, "
    "shard, context, tensor, pipeline, expert) and its degree, then optionally ':' and the "
    "pipeline schedule's short name and micro-batches (gpipe4, 1f1b8, interleaved8v2, zb8): "
    "e.g. 'dp2xfsdp4xtp2', 'fsdp2xtp2xpp2:1f1b8'; 'single' is one device"
)
_PART = re.compile(r"([a-z]+)(-1|[1-9][0-9]*)")
_COUNTS = re.compile(r"([1-9][0-9]*)(?:v([1-9][0-9]*))?")


def _has_virtual(kind: type) -> bool:
    """Whether a schedule class takes ``virtual=`` (model chunks per stage)."""
    return any(f.name == "virtual" for f in dataclasses.fields(kind))


def _schedule_name(schedule: Any) -> str | None:
    """``schedule``'s part of a layout's name (``"1f1b8"``, ``"interleaved8v2"``), or None
    for a schedule :data:`jaxcoll._core.roles.SCHEDULES` does not name."""
    short = next((k for k, kind in roles.SCHEDULES.items() if type(schedule) is kind), None)
    if short is None:
        return None
    virtual = f"v{schedule.virtual}" if _has_virtual(type(schedule)) else ""
    return f"{short}{schedule.microbatches}{virtual}"


def short_name(layout: Any) -> tuple[str, str]:
    """``(layout's short name, "")``, or ``("", why it has none)``."""
    if not layout.by_degree:
        return "", "names mesh axes (or none) where a short name gives degrees"
    if layout.rules:
        return "", f"has rules={dict(layout.rules)!r}, which a short name does not say"
    if layout.attention is not None and type(layout.attention).__name__ != "Ring":
        return "", f"has attention={layout.attention!r}, which a short name does not say"
    schedule = "" if layout.schedule is None else _schedule_name(layout.schedule)
    if schedule is None:
        return "", f"has the schedule {layout.schedule!r}, which has no short name"
    given = [(a, getattr(layout, r)) for r, a in ABBREVIATIONS.items()]
    given = [(a, d) for a, d in given if d is not None]
    if given == [(ABBREVIATIONS[Role.REPLICATE], 1)] and not schedule:
        return SINGLE, ""
    name = "x".join(f"{a}{d}" for a, d in given)
    return name + (f":{schedule}" if schedule else ""), ""


def parse(name: str) -> dict[str, Any]:
    """The keyword arguments of the :class:`~jaxcoll.dp.Layout` that ``name`` names.

    Raises:
        ValueError: ``name`` is not in the grammar; the message names the bad part.
    """
    if name == SINGLE:
        return {Role.REPLICATE.value: 1}
    roles_part, colon, schedule_part = name.partition(":")
    given: dict[str, Any] = {}
    for part in roles_part.split("x"):
        found = _PART.fullmatch(part)
        role = _BY_ABBREVIATION.get(found[1]) if found else None
        if found is None or role is None or role.value in given:
            why = "repeats a role" if role is not None else "is not a role and its degree"
            raise ValueError(f"dp.Layout.parse: {name!r}: {part!r} {why}; {GRAMMAR}.")
        given[role.value] = int(found[2])
    if colon:
        given["schedule"] = _parse_schedule(name, schedule_part)
    return given


def _parse_schedule(name: str, text: str) -> Any:
    """The schedule value that ``text`` (the part of ``name`` after ``:``) names."""
    table = roles.SCHEDULES
    if not table:
        raise ValueError(
            f"dp.Layout.parse: {name!r} names a pipeline schedule, and no schedule is known: "
            f"they are jaxcoll.parallel's values; import it first (from jaxcoll import "
            f"parallel)."
        )
    for short in sorted(table, key=len, reverse=True):
        counts = _COUNTS.fullmatch(text[len(short) :]) if text.startswith(short) else None
        if counts is None:
            continue
        kind = table[short]
        if counts[2] is None:
            return kind(int(counts[1]))
        if not _has_virtual(kind):
            raise ValueError(
                f"dp.Layout.parse: {name!r}: the schedule {short!r} has no model chunks per "
                f"stage ('v{counts[2]}'); only an interleaved schedule takes them "
                f"('interleaved8v2')."
            )
        return kind(int(counts[1]), virtual=int(counts[2]))
    raise ValueError(
        f"dp.Layout.parse: {name!r}: {text!r} is no schedule; the schedule is one of "
        f"{sorted(table)} followed by its micro-batches ('1f1b8'; interleaved: "
        f"'interleaved8v2', v the model chunks per stage)."
    )
