"""``algorithm="auto"``: pick an algorithm from the table the benchmark measured.

The table (``jaxcoll/algorithms/_table.py``) is keyed by platform (``jax.default_backend()``),
topology (``"single_process"`` or ``"multi_process"``), op and message size in bytes per rank.
Regenerate it on the target machine with ``jaxcoll-bench --update-table`` (see
``docs/benchmarks.md``). Where the table has no entry, ``auto`` means ``"native"``: the lax
collective, which XLA lowers to the platform's library (NCCL on GPU).
"""

from __future__ import annotations

import jax

from ._table import TABLE

OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")


def topology() -> str:
    """``"multi_process"`` under ``jax.distributed`` with several processes, else single."""
    return "multi_process" if jax.process_count() > 1 else "single_process"


def choose(
    op: str,
    nbytes: int,
    *,
    group_size: int,
    two_level: bool,
    platform: str | None = None,
    topo: str | None = None,
    table: dict | None = None,
) -> str:
    """The algorithm ``auto`` uses for ``op`` on a message of ``nbytes`` bytes per rank.

    Args:
        op: one of ``all_reduce``, ``reduce``, ``broadcast``, ``all_gather``,
            ``reduce_scatter``.
        nbytes: message size per rank in bytes.
        group_size: the number of ranks; a group of one always gets ``"native"``.
        two_level: whether the group is a tuple of mesh axes (needed by ``"hierarchical"``).
        platform: ``"cpu"``, ``"gpu"``, ...; defaults to ``jax.default_backend()``.
        topo: ``"single_process"`` or ``"multi_process"``; defaults to :func:`topology`.
        table: the table to read; defaults to the checked-in one.

    Returns:
        ``"native"``, ``"ring"``, ``"tree"`` or ``"hierarchical"``.

    Example::

        >>> from jaxcoll.algorithms import choose
        >>> choose("all_reduce", 4096, group_size=8, two_level=False, platform="cpu",
        ...        topo="single_process")
        'native'
    """
    if group_size == 1:
        return "native"
    platform = jax.default_backend() if platform is None else platform
    topo = topology() if topo is None else topo
    table = TABLE if table is None else table
    rows = table.get(platform, {}).get(topo, {}).get(op, ())
    for max_bytes, algorithm in rows:
        if max_bytes is None or nbytes <= max_bytes:
            if algorithm == "hierarchical" and not two_level:
                return "native"
            return algorithm
    return "native"


def table_from_results(rows: list[dict], *, platform: str, topo: str) -> dict:
    """Build a table section from benchmark rows (dicts with op, algorithm, bytes, time_us).

    For each op, the fastest algorithm at each measured size wins; neighbouring sizes with the
    same winner merge into one ``(max_bytes, algorithm)`` entry, and the last becomes
    unbounded.
    """
    best: dict[str, dict[int, tuple[float, str]]] = {}
    for row in rows:
        if row.get("wrong", 0):
            continue
        per_op = best.setdefault(row["op"], {})
        cur = per_op.get(row["bytes"])
        if cur is None or row["time_us"] < cur[0]:
            per_op[row["bytes"]] = (row["time_us"], row["algorithm"])
    section: dict[str, list] = {}
    for op, sizes in best.items():
        entries: list[list] = []
        for size in sorted(sizes):
            algorithm = sizes[size][1]
            if entries and entries[-1][1] == algorithm:
                entries[-1][0] = size
            else:
                entries.append([size, algorithm])
        entries[-1][0] = None
        section[op] = [tuple(e) for e in entries]
    return {platform: {topo: section}}
