"""``jaxcoll-bench``: an nccl-tests-style benchmark of jaxcoll's collectives and algorithms.

For each op x algorithm x size (doubling from ``--min-bytes`` to ``--max-bytes``) it warms up,
times ``--iters`` runs of one jitted ``shard_map`` program, checks every element of the result
against a NumPy oracle, and prints::

    op  algorithm  size  count  dtype  time(us)  algbw(GB/s)  busbw(GB/s)  #wrong

``time`` is the median. ``algbw = size / time``; ``busbw = algbw * factor`` with nccl-tests'
factors: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast and reduce 1.
``size`` is the per-rank buffer for all_reduce, broadcast and reduce, the gathered output for
all_gather and the input for reduce_scatter (as nccl-tests counts them). The header also gives
the machine's memory-copy bandwidth (read + write), the ceiling for busbw on simulated devices.

Examples::

    jaxcoll-bench --ops all_reduce --algorithms native,ring,tree --max-bytes 16M
    jaxcoll-bench --ops all_reduce,all_gather --mesh 2x4 --algorithms native,hierarchical \
        --csv out.csv --json out.json --plot out.png
    jaxcoll-bench --ops all --algorithms native,ring,tree,hierarchical --mesh 2x4 --update-table

``--update-table`` writes the winners to the user's ``auto`` table
(``$JAXCOLL_AUTO_TABLE``, else ``~/.cache/jaxcoll/auto_table.json``; see
:mod:`jaxcoll.algorithms.auto`), never into the installed package.

Multi-process: start one copy per process with ``--coordinator HOST:PORT --num-processes N
--process-id K``, or under the ``jaxcoll-run`` launcher, whose variables
(``JAXCOLL_COORDINATOR_ADDRESS``, ``JAXCOLL_NUM_PROCESSES``, ``JAXCOLL_PROCESS_ID``,
``JAX_NUM_CPU_DEVICES``) are the defaults; only process 0 prints.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from typing import overload

import jax

from jaxcoll.algorithms import ALGORITHMS, user_table_path
from jaxcoll.algorithms.auto import topology

from .cases import OPS
from .output import write_csv, write_json
from .plot import plot_busbw
from .runner import run
from .tuning import update_table


def parse_bytes(text: str) -> int:
    """``"4K"`` -> 4096, ``"16M"`` -> 16777216, ``"1G"``, or a plain number of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 4K, 16M or 1G, got {text!r}")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


@overload
def _env(*names: str, default: str) -> str: ...
@overload
def _env(*names: str, default: None = None) -> str | None: ...
def _env(*names: str, default: str | None = None) -> str | None:
    """The first of ``names`` set in the environment."""
    return next((os.environ[k] for k in names if os.environ.get(k)), default)


def _comma_list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of ``jaxcoll-bench`` (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="jaxcoll-bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ops", default="all_reduce", help=f"comma list of {', '.join(OPS)} or all")
    p.add_argument(
        "--algorithms", default="native,ring,tree", help=f"comma list of {', '.join(ALGORITHMS)}"
    )
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("4K"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("16M"))
    p.add_argument("--iters", type=int, default=10, help="timed runs per row (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per row")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--devices",
        type=int,
        default=int(_env("JAX_NUM_CPU_DEVICES", default="8")),
        help="simulated CPU devices per process when the backend is CPU (default "
        "$JAX_NUM_CPU_DEVICES, set by jaxcoll-run --devices-per-proc, else 8)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="OUTERxINNER, e.g. 2x4: a 2-D mesh (needed by hierarchical); default "
        "processes x local devices when multi-process, else 1-D",
    )
    p.add_argument("--csv", default=None, help="write rows to this CSV file")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    p.add_argument("--plot", default=None, help="write busbw vs size (PNG) to this file")
    p.add_argument(
        "--update-table",
        action="store_true",
        help="write the winners to the user's auto table (algorithm=auto): "
        "--table-file, else $JAXCOLL_AUTO_TABLE, else "
        "~/.cache/jaxcoll/auto_table.json",
    )
    p.add_argument(
        "--table-file",
        default=None,
        metavar="PATH",
        help="with --update-table: write this file instead",
    )
    p.add_argument(
        "--no-malloc-tune",
        action="store_true",
        help="keep glibc's default allocator settings (see docs/benchmarks.md)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=_env("JAXCOLL_COORDINATOR_ADDRESS", "JAXCOLL_COORDINATOR"),
        help="process 0's coordination service (default "
        "$JAXCOLL_COORDINATOR_ADDRESS, set by jaxcoll-run)",
    )
    p.add_argument(
        "--num-processes", type=int, default=int(_env("JAXCOLL_NUM_PROCESSES", default="1"))
    )
    p.add_argument("--process-id", type=int, default=int(_env("JAXCOLL_PROCESS_ID", default="0")))
    a = p.parse_args(argv)
    a.ops = list(OPS) if a.ops == "all" else _comma_list(a.ops)
    a.algorithms = _comma_list(a.algorithms)
    for o in a.ops:
        if o not in OPS:
            p.error(f"--ops: {o!r} is not one of {', '.join(OPS)}")
    for s in a.algorithms:
        if s not in ALGORITHMS:
            p.error(f"--algorithms: {s!r} is not one of {', '.join(ALGORITHMS)}")
    if a.min_bytes > a.max_bytes:
        p.error(f"--min-bytes {a.min_bytes} is larger than --max-bytes {a.max_bytes}")
    if a.mesh is not None and not re.fullmatch(r"\d+x\d+", a.mesh.lower()):
        p.error(f"--mesh: expected OUTERxINNER such as 2x4, got {a.mesh!r}")
    if a.table_file is not None and not a.update_table:
        p.error("--table-file is only used with --update-table; add --update-table")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``jaxcoll-bench`` and ``python -m jaxcoll.bench``; returns the exit code
    (1 if any result was wrong)."""
    a = parse_args(argv)
    rows = run(a)
    if jax.process_index() == 0:
        if a.csv:
            write_csv(rows, a.csv)
        if a.json:
            write_json(rows, a.json)
        if a.plot:
            plot_busbw(rows, a.plot)
        if a.update_table:
            platform = jax.default_backend()
            path = update_table(rows, platform=platform, topo=topology(), path=a.table_file)
            print(f"# wrote the auto table for {platform} to {path}")
            if path.resolve() != user_table_path().resolve():
                print(f"# algorithm='auto' reads it when JAXCOLL_AUTO_TABLE={path}")
        print(f"# {sum(r['wrong'] for r in rows)} wrong elements in {len(rows)} rows")
    return 1 if any(r["wrong"] for r in rows) else 0
