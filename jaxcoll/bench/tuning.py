"""``--update-table``: write the measured winners to the user's ``auto`` table file.

The file is the one :func:`jaxcoll.algorithms.user_table_path` names (or ``--table-file``);
what it held for other platforms, topologies and ops is kept. The installed package is never
written: its ``auto_table.json`` holds the shipped defaults only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from jaxcoll.algorithms import table_from_results, user_table_path
from jaxcoll.algorithms.auto import Table, merge_tables, read_table


def dumps(table: Table) -> str:
    """The table as JSON, one line per op (the layout of the shipped defaults)."""

    def obj(items: dict, indent: int, value) -> str:
        pad = " " * indent
        lines = [f"{pad}  {json.dumps(key)}: {value(v)}" for key, v in items.items()]
        return "{\n" + ",\n".join(lines) + f"\n{pad}}}"

    def entries(rows: list) -> str:
        return json.dumps([list(e) for e in rows])

    return obj(table, 0, lambda topos: obj(topos, 2, lambda ops: obj(ops, 4, entries))) + "\n"


def write_table(table: Table, path: str | os.PathLike) -> Path:
    """Write ``table`` to ``path`` (creating its folders) in one step: readers never see a
    half-written file. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(dumps(table))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def update_table(
    rows: list[dict], *, platform: str, topo: str, path: str | os.PathLike | None = None
) -> Path:
    """Merge the winners of ``rows`` for (platform, topo) into the table file at ``path``.

    Args:
        rows: benchmark rows (see :func:`jaxcoll.algorithms.table_from_results`).
        platform: the platform they were measured on (``jax.default_backend()``).
        topo: ``"single_process"`` or ``"multi_process"``.
        path: the file; defaults to :func:`jaxcoll.algorithms.user_table_path`.

    Returns:
        The path written.

    Raises:
        ValueError: the existing file is malformed (it is left as it is).
    """
    path = Path(user_table_path() if path is None else path)
    old = read_table(path) if path.exists() else {}
    return write_table(
        merge_tables(old, table_from_results(rows, platform=platform, topo=topo)), path
    )
