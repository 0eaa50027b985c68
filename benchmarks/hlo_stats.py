"""What a compiled step does, read from its optimized HLO: collectives and their bytes.

Used by the benchmarks that compare jaxcoll with plain JAX (``nd.py --hlo``, ``memory.py
--hlo``, ``memory_gpt.py --hlo``) to say where a row's time and memory go. For every
all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute of the compiled
per-device program: how many run per step and how many bytes their results hold, counted
once per execution (a collective in a ``while`` body whose trip count XLA knows counts that
many times; an unknown trip count counts once and is flagged with ``?``).
"""

from __future__ import annotations

import re
from collections import defaultdict

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A"}
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "f64": 8, "s64": 8, "u64": 8}
_BYTES |= {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\(")
_CALLS = re.compile(
    r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _bytes(shapes: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shapes):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES.get(dtype, 4)
    return total


def computations(text: str) -> tuple[str | None, dict[str, list[str]]]:
    """``(entry, comps)`` of the HLO module ``text``: the entry computation's name and every
    computation's lines (its body, without the closing brace) by name."""
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            name = m.group(2)
            comps[name] = []
            entry = name if m.group(1) else entry
            continue
        if name is not None and line.strip() != "}":
            comps[name].append(line)
    return entry, comps


def collectives(text: str) -> dict[str, tuple[int, int, bool]]:
    """``{kind: (count per step, result bytes per step, some trip count unknown)}`` of the
    optimized HLO module ``text`` (``compiled.as_text()``)."""
    entry, comps = computations(text)
    mult: dict[str, tuple[int, bool]] = {}

    def visit(comp: str, k: int, unsure: bool) -> None:
        if comp not in comps:
            return
        old = mult.get(comp, (0, False))
        mult[comp] = (old[0] + k, old[1] or unsure)
        for line in comps[comp]:
            trip = _TRIP.search(line)
            for role, callee in _CALLS.findall(line):
                if role == "body" and " while(" in line:
                    n = int(trip.group(1)) if trip else 1
                    visit(callee, k * n, unsure or trip is None)
                elif role in ("to_apply", "calls", "true_computation", "false_computation"):
                    visit(callee, k, unsure)
            for group in _BRANCHES.findall(line):
                for callee in group.split(","):
                    visit(callee.strip().lstrip("%"), k, unsure)

    if entry is not None:
        visit(entry, 1, False)
    out: dict[str, list] = defaultdict(lambda: [0, 0, False])
    for comp, lines in comps.items():
        k, unsure = mult.get(comp, (0, False))
        if not k:
            continue
        for line in lines:
            m = _OP.search(line)
            if m:
                row = out[m.group(2)]
                row[0] += k
                row[1] += k * _bytes(m.group(1))
                row[2] = row[2] or unsure
    return {kind: tuple(out[kind]) for kind in KINDS if kind in out}


def summary(compiled) -> str:
    """One line: each kind's count and MiB per step, e.g. ``AG 24 x 3.1 MiB, RS 12 x ...``."""
    parts = []
    for kind, (count, size, unsure) in collectives(compiled.as_text()).items():
        short = SHORT.get(kind, "CP")
        parts.append(f"{short} {count}{'?' if unsure else ''} x {size / 2**20:.2f} MiB")
    return ", ".join(parts) or "none"


def flops(compiled) -> float:
    """The per-device program's ``cost_analysis()["flops"]``."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))
