"""``algorithm="auto"``: pick an algorithm from the table the benchmark measured.

A table maps platform (``jax.default_backend()``: ``"cpu"``, ``"gpu"``, ...), topology
(``"single_process"`` or ``"multi_process"``) and op to a list of ``[max_bytes, algorithm]``
entries: the first entry whose ``max_bytes`` is at least the message size per rank (``null``:
no limit) wins. As JSON::

    {"cpu": {"single_process": {"all_reduce": [[4096, "tree"], [null, "native"]]}}}

Where the table comes from, per platform, topology and op (an entry in the user file replaces
the default list for that op; everything else falls through to the defaults):

1. the user file: the path in ``$JAXCOLL_AUTO_TABLE`` if that is set, else
   ``${XDG_CACHE_HOME:-~/.cache}/jaxcoll/auto_table.json``; used when it exists.
   ``jaxcoll-bench --update-table`` writes it on the target machine (see
   ``docs/benchmarks.md``); nothing ever writes into the installed package;
2. the defaults shipped with the package, ``jaxcoll/algorithms/auto_table.json`` (package
   data): on CPU in one process, native for every op and size.

Where neither has an entry, ``auto`` means ``"native"``: the lax collective, which XLA lowers
to the platform's library (NCCL on GPU). The merged table is read once and cached; the cache
is keyed on the user file's path and modification time, so a rewritten file is seen by the
next trace. A user file that is not a valid table raises :class:`ValueError` naming the file
and what is wrong; it is never silently ignored.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import jax

OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter")
CHOICES = ("native", "ring", "tree", "hierarchical")
"""The algorithms a table entry may name."""
TOPOLOGIES = ("single_process", "multi_process")
ENV_VAR = "JAXCOLL_AUTO_TABLE"
"""Environment variable naming the user table file."""
DEFAULTS_FILE = "auto_table.json"
"""The shipped defaults, package data of :mod:`jaxcoll.algorithms`."""

Table = dict[str, dict[str, dict[str, list[tuple[int | None, str]]]]]

_FIX = (
    "Fix the file, rerun `jaxcoll-bench --update-table`, or delete the file to use the "
    "shipped defaults."
)
_defaults: list[Table] = []  # the parsed shipped table, once
_cached: tuple[tuple, Table] | None = None  # (user file's path and stat, merged table)


def topology() -> str:
    """``"multi_process"`` under ``jax.distributed`` with several processes, else single."""
    return "multi_process" if jax.process_count() > 1 else "single_process"


def user_table_path() -> Path:
    """The user's table file, whether or not it exists.

    Returns:
        ``$JAXCOLL_AUTO_TABLE`` if set (and not empty), else
        ``$XDG_CACHE_HOME/jaxcoll/auto_table.json`` (``~/.cache`` when ``XDG_CACHE_HOME`` is
        unset or not an absolute path).

    Example::

        >>> from jaxcoll.algorithms import user_table_path
        >>> user_table_path()  # with neither variable set
        PosixPath('/home/me/.cache/jaxcoll/auto_table.json')
    """
    return Path(_user_path())


def _user_path() -> str:
    env = os.environ
    return _path_for(env.get(ENV_VAR), env.get("XDG_CACHE_HOME"), env.get("HOME"))


@functools.lru_cache(maxsize=16)
def _path_for(given: str | None, cache: str | None, home: str | None) -> str:
    """The user file for these variables (cached: ``choose`` asks on every trace). ``home``
    is part of the cache key only: ``expanduser`` reads ``$HOME``."""
    if given:
        return os.path.expanduser(given)
    root = (
        cache if cache and os.path.isabs(cache) else os.path.join(os.path.expanduser("~"), ".cache")
    )
    return os.path.join(root, "jaxcoll", "auto_table.json")


def _entry(where: str, value: Any, last_bound: int | None) -> tuple[int | None, str]:
    if not (isinstance(value, list) and len(value) == 2):
        raise ValueError(f"{where} must be a pair [max_bytes, algorithm], got {value!r} instead")
    bound, algorithm = value
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
        raise ValueError(
            f"{where}: max_bytes must be a non-negative integer or null, got {bound!r} instead"
        )
    if algorithm not in CHOICES:
        raise ValueError(
            f"{where}: algorithm must be one of {', '.join(CHOICES)}, got {algorithm!r} instead"
        )
    if last_bound is not None and bound is not None and bound <= last_bound:
        raise ValueError(
            f"{where}: max_bytes must grow from entry to entry, got {bound} after {last_bound}"
        )
    return bound, algorithm


def _mapping(where: str, value: Any, keys: tuple[str, ...] | None) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object, got {type(value).__name__} instead")
    if keys is not None:
        for key in value:
            if key not in keys:
                raise ValueError(f"{where}: key {key!r} is not one of {', '.join(keys)}")
    return value


def _validate(data: Any) -> Table:
    """``data`` (parsed JSON) as a table of tuples; ValueError saying where it is wrong."""
    table: Table = {}
    for platform, topos in _mapping("the top level", data, None).items():
        for topo, ops in _mapping(f"[{platform!r}]", topos, TOPOLOGIES).items():
            for op, entries in _mapping(f"[{platform!r}][{topo!r}]", ops, OPS).items():
                where = f"[{platform!r}][{topo!r}][{op!r}]"
                if not isinstance(entries, list) or not entries:
                    raise ValueError(
                        f"{where} must be a non-empty list of [max_bytes, "
                        f"algorithm], got {entries!r} instead"
                    )
                rows: list[tuple[int | None, str]] = []
                for i, value in enumerate(entries):
                    if rows and rows[-1][0] is None:
                        raise ValueError(
                            f"{where}[{i}] follows an entry with max_bytes null, "
                            f"which already covers every size; remove it"
                        )
                    rows.append(_entry(f"{where}[{i}]", value, rows[-1][0] if rows else None))
                table.setdefault(platform, {}).setdefault(topo, {})[op] = rows
    return table


def read_table(path: str | os.PathLike) -> Table:
    """Read and check a table file.

    Args:
        path: a JSON file in the format of the module docstring.

    Returns:
        The table, each entry a ``(max_bytes, algorithm)`` tuple.

    Raises:
        ValueError: the file is not JSON or not a valid table; the message names the file,
            the place in it and what is wrong.
        OSError: the file cannot be read.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise OSError(
            f"auto: cannot read the algorithm table {path}: {err}. Fix its "
            f"permissions or point ${ENV_VAR} at another file."
        ) from err
    return _parse(text, str(path))


def _parse(text: str, name: str) -> Table:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"auto: the algorithm table {name} is not valid JSON: {err.msg} at "
            f"line {err.lineno}, column {err.colno}. {_FIX}"
        ) from None
    try:
        return _validate(data)
    except ValueError as err:
        raise ValueError(f"auto: the algorithm table {name} is malformed: {err}. {_FIX}") from None


def merge_tables(base: Table, over: Table) -> Table:
    """``base`` with every (platform, topology, op) list of ``over`` put in its place.

    Neither argument is changed.
    """
    merged: Table = {}
    for table in (base, over):
        for platform, topos in table.items():
            for topo, ops in topos.items():
                section = merged.setdefault(platform, {}).setdefault(topo, {})
                section.update((op, list(entries)) for op, entries in ops.items())
    return merged


def default_table() -> Table:
    """The table shipped with jaxcoll (``jaxcoll/algorithms/auto_table.json``)."""
    if not _defaults:
        resource = resources.files(__package__).joinpath(DEFAULTS_FILE)
        _defaults.append(_parse(resource.read_text(encoding="utf-8"), str(resource)))
    return merge_tables(_defaults[0], {})


def _current() -> Table:
    """The defaults merged with the user file, cached on the file's path and stat."""
    global _cached
    path = _user_path()
    try:
        st = os.stat(path)
        key: tuple = (path, st.st_mtime_ns, st.st_size, st.st_ino)
    except FileNotFoundError:
        key = (path, None)
    cached = _cached
    if cached is not None and cached[0] == key:
        return cached[1]
    table = default_table()
    if key[1] is not None:
        table = merge_tables(table, read_table(path))
    _cached = (key, table)
    return table


def load_table() -> Table:
    """The table ``auto`` uses now: the shipped defaults merged with the user file."""
    return merge_tables(_current(), {})


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
        table: the table to read; defaults to :func:`load_table` (the shipped defaults merged
            with the user file, see the module docstring).

    Returns:
        ``"native"``, ``"ring"``, ``"tree"`` or ``"hierarchical"``.

    Raises:
        ValueError: ``table`` is None and the user file is malformed.

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
    table = _current() if table is None else table
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
