"""Read a job's flight records and name the process that diverged or stalled first.

Usage::

    python -m jaxcoll.trace DIR        # the process<k>.json files a job's processes wrote

Each process of a job keeps a ring buffer of the programs with collectives it dispatched
(:func:`jaxcoll.dump_trace`) and writes it when it ends early, on SIGUSR1 and, under
``jaxcoll-run``, at exit. Every call carries its sequence number within its group of
processes (the processes whose devices its arrays span), so the k-th call of a group must be
the same program on each of its processes. :func:`analyze` walks each group's calls in order
and reports, for the earliest problem:

* **disagree**: at call #k the processes of a group ran different programs (op, options or
  input shapes): each process's op and call site (``file:line``);
* **missing**: some processes issued call #k and wait in it, others never issued it: where
  those others were instead (their last call and their Python stack when they wrote);
* **stalled**: every process issued call #k and none saw it complete;
* **unrecorded**: some processes wait in call #k and others of the group wrote no record at
  all (killed by SIGKILL or the OOM killer, or their host is gone).

Then one line per process: why it wrote, its last completed call, its oldest pending one and
where its main thread was. ``jaxcoll-run`` prints this after a job fails, and warns when the
records of a job that succeeded disagree (a silent wrong answer, e.g. int32 against float32).
This module reads JSON only: it imports neither JAX nor the rest of jaxcoll.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "analyze", "load", "main", "report"]

_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_DIRS = tuple(
    {
        p + os.sep
        for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "purelib", "platlib"))
        if p
    }
)


@dataclass
class Finding:
    """One problem in a group's calls: ``kind`` is ``disagree``, ``missing``, ``stalled`` or
    ``unrecorded``."""

    kind: str
    group: tuple[int, ...]
    seq: int  # the call's sequence number within the group
    at: float  # when its earliest process issued it (wall clock)
    text: str
    processes: tuple[int, ...] = field(default=())  # the ones named as the cause


def load(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """Every process's record in ``directory`` (``process*.json``), the newest per process,
    sorted by process index. Unreadable files are skipped."""
    newest: dict[int, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(os.fspath(directory), "process*.json"))):
        try:
            with open(path) as fh:
                rec = json.load(fh)
            k = int(rec["process"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if k not in newest or rec.get("time", 0) >= newest[k].get("time", 0):
            newest[k] = rec
    return [newest[k] for k in sorted(newest)]


def ranges(items: Sequence[int]) -> str:
    """``0-3,5`` for ``[0, 1, 2, 3, 5]``."""
    items = sorted(items)
    out, i = [], 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if j == i else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


def _short(path: str) -> str:
    """``path`` relative to the working directory when under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _site(call: dict[str, Any]) -> str:
    file, _, line = call["site"].rpartition(":")
    return f"{_short(file)}:{line}"


def _desc(call: dict[str, Any]) -> str:
    options = f" {call['options']}" if call.get("options") else ""
    return f"{call['op']}({call['args']}){options} at {_site(call)}"


def _where(rec: dict[str, Any]) -> str | None:
    """The innermost frame of the main thread outside jaxcoll, JAX and Python's libraries."""
    for frame in reversed(rec.get("stack", [])):
        file = frame.split(":", 1)[0]
        if not file.startswith(_PKG) and not file.startswith(_LIBRARY_DIRS):
            path, _, rest = frame.partition(":")
            return f"{_short(path)}:{rest}"
    return None


def analyze(records: Sequence[dict[str, Any]]) -> list[Finding]:
    """The problems in the records' calls, earliest first (see the module docstring)."""
    by_proc = {int(r["process"]): r for r in records}
    groups: dict[tuple[int, ...], dict[int, dict[int, dict[str, Any]]]] = {}
    for k, rec in by_proc.items():
        for call in rec.get("calls", []):
            group = tuple(call["group"])
            groups.setdefault(group, {}).setdefault(k, {})[int(call["group_seq"])] = call
    findings = []
    for group, per_proc in sorted(groups.items()):
        if len(group) < 2:
            continue
        found = _check_group(group, per_proc, by_proc)
        if found is not None:
            findings.append(found)
    return sorted(findings, key=lambda f: f.at)


def _check_group(
    group: tuple[int, ...],
    per_proc: dict[int, dict[int, dict[str, Any]]],
    by_proc: dict[int, dict[str, Any]],
) -> Finding | None:
    recorded = [p for p in group if p in by_proc]  # processes that wrote a record
    silent = [p for p in group if p not in by_proc]
    calls = {p: per_proc.get(p, {}) for p in recorded}
    # The ring buffer may have dropped a process's oldest calls: compare from the first
    # call every process still holds.
    start = max((min(c) if c else 1) for c in calls.values())
    last = max((max(c) if c else 0) for c in calls.values())
    for seq in range(start, last + 1):
        here = {p: c[seq] for p, c in calls.items() if seq in c}
        if not here:
            continue
        at = min(c["issued"] for c in here.values())
        absent = [p for p in recorded if p not in here]
        if not absent:
            prints = {c["fingerprint"] for c in here.values()}
            if len(prints) > 1:
                return _disagree(group, seq, at, here)
            if all(c["done"] is None for c in here.values()) and silent:
                return _unrecorded(group, seq, here, silent)
            if all(c["done"] is None for c in here.values()):
                call = here[min(here)]
                return Finding(
                    "stalled",
                    group,
                    seq,
                    at,
                    f"call #{seq} of processes {ranges(group)} ({_desc(call)}) was issued "
                    f"by every process and completed on none: they wait in it together (a "
                    f"transport fault, or a device that stopped).",
                    tuple(group),
                )
            continue
        return _missing(group, seq, at, here, absent, calls, by_proc)
    return None


def _unrecorded(
    group: tuple[int, ...], seq: int, here: dict[int, dict[str, Any]], silent: list[int]
) -> Finding:
    """Every process with a record waits in call #seq; ``silent`` wrote none (killed by
    SIGKILL or the OOM killer, or its host is gone)."""
    p0 = min(here)
    return Finding(
        "unrecorded",
        group,
        seq,
        min(c["issued"] for c in here.values()),
        f"call #{seq} of processes {ranges(group)}: process(es) {ranges(list(here))} "
        f"wait in it ({_desc(here[p0])}); process(es) {ranges(silent)} wrote no record "
        f"(killed, or its host is gone).",
        tuple(silent),
    )


def _disagree(
    group: tuple[int, ...], seq: int, at: float, here: dict[int, dict[str, Any]]
) -> Finding:
    counts: dict[str, list[int]] = {}
    for p, c in sorted(here.items()):
        counts.setdefault(c["fingerprint"], []).append(p)
    odd: tuple[int, ...] = ()
    if len(counts) == 2 and len(here) > 2:
        small = min(counts.values(), key=len)
        if len(small) < len(here) - len(small):
            odd = tuple(small)
    listing = "; ".join(f"process {p} runs {_desc(c)}" for p, c in sorted(here.items()))
    lead = (
        f"process(es) {ranges(odd)} diverged at call #{seq} of processes {ranges(group)}"
        if odd
        else f"the processes disagree at call #{seq} of processes {ranges(group)}"
    )
    return Finding("disagree", group, seq, at, f"{lead}: {listing}.", odd or tuple(here))


def _missing(
    group: tuple[int, ...],
    seq: int,
    at: float,
    here: dict[int, dict[str, Any]],
    absent: list[int],
    calls: dict[int, dict[int, dict[str, Any]]],
    by_proc: dict[int, dict[str, Any]],
) -> Finding:
    p0 = min(here)
    waiting = f"process(es) {ranges(list(here))} issued it ({_desc(here[p0])})"
    parts = []
    for q in absent:
        rec = by_proc[q]
        mine = calls[q]
        prev = f"its last call there was #{max(mine)}" if mine else "it issued none there"
        where = _where(rec)
        at_q = f", at {where}" if where else ""
        why = str(rec.get("reason", "?"))
        when = "; it exited" if why == "exit" else f" when it wrote: {_clip(why)}"
        parts.append(f"process {q} never issued it ({prev}{at_q}{when})")
    return Finding(
        "missing",
        group,
        seq,
        at,
        f"call #{seq} of processes {ranges(group)}: {waiting}; {'; '.join(parts)}.",
        tuple(absent),
    )


def _clip(text: str, width: int = 160) -> str:
    text = text.strip()
    return text if len(text) <= width else text[: width - 3] + "..."


def _process_line(rec: dict[str, Any]) -> str:
    calls = rec.get("calls", [])
    done = [c for c in calls if c["done"] is not None]
    pending = [c for c in calls if c["done"] is None]
    parts = [f"{rec.get('calls_recorded', len(calls))} call(s)"]
    if done:
        c = done[-1]
        parts.append(f"last completed #{c['group_seq']} of {ranges(c['group'])} {_desc(c)}")
    if pending:
        c = pending[0]
        waited = rec["time"] - c["issued"]
        parts.append(
            f"pending #{c['group_seq']} of {ranges(c['group'])} {_desc(c)} for {waited:.1f}s"
        )
    where = _where(rec)
    if where:
        parts.append(f"main thread at {where}")
    reason = _clip(str(rec.get("reason", "?")))
    return f"process {rec['process']} ({reason}): " + "; ".join(parts)


def report(records: Sequence[dict[str, Any]], expected: int | None = None) -> list[str]:
    """The analysis as lines: the first finding, the others, then one line per process."""
    lines = []
    findings = analyze(records)
    if findings:
        lines.append(f"first: {findings[0].text}")
        lines += [f"then: {f.text}" for f in findings[1:]]
    else:
        lines.append(
            "no disagreement, missing call or stall among the recorded calls (a process may "
            "be stuck outside any recorded call: see its main thread below)."
        )
    have = {int(r["process"]) for r in records}
    n = expected or max((int(r.get("num_processes", 0)) for r in records), default=0)
    absent = [k for k in range(n) if k not in have]
    if absent:
        lines.append(f"process(es) {ranges(absent)} wrote no record (killed, or never started).")
    lines += [_process_line(r) for r in records]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxcoll.trace DIR``: print the analysis; exit 1 when it finds a problem."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m jaxcoll.trace DIR  (the process<k>.json flight records)")
        return 2
    records = load(args[0])
    if not records:
        print(f"jaxcoll.trace: no flight record (process*.json) in {args[0]!r}.", file=sys.stderr)
        return 2
    print(f"flight records of {len(records)} process(es) in {args[0]}:")
    for line in report(records):
        print(f"  {line}")
    return 1 if analyze(records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
