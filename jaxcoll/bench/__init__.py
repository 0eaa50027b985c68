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

Multi-process: start one copy per process with ``--coordinator HOST:PORT --num-processes N
--process-id K`` (or under the ``jaxcoll-run`` launcher); only process 0 prints.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import json
import os
import re
import sys
import time
from collections.abc import Sequence

import numpy as np

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
ALGS = ("native", "ring", "tree", "hierarchical")
FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def parse_bytes(text: str) -> int:
    """``"4K"`` -> 4096, ``"16M"`` -> 16777216, ``"1G"``, or a plain number of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 4K, 16M or 1G, got {text!r}")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxcoll-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="all_reduce", help=f"comma list of {', '.join(OPS)} or all")
    p.add_argument("--algorithms", default="native,ring,tree",
                   help=f"comma list of {', '.join(ALGS)}, auto")
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("4K"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("16M"))
    p.add_argument("--iters", type=int, default=10, help="timed runs per row (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per row")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--devices", type=int, default=8,
                   help="simulated CPU devices per process when the backend is CPU (default 8)")
    p.add_argument("--mesh", default=None,
                   help="OUTERxINNER, e.g. 2x4: a 2-D mesh (needed by hierarchical); default "
                        "processes x local devices when multi-process, else 1-D")
    p.add_argument("--csv", default=None, help="write rows to this CSV file")
    p.add_argument("--json", default=None, help="write rows to this JSON file")
    p.add_argument("--plot", default=None, help="write busbw vs size (PNG) to this file")
    p.add_argument("--update-table", action="store_true",
                   help="write the winners into jaxcoll/algorithms/_table.py (algorithm=auto)")
    p.add_argument("--no-malloc-tune", action="store_true",
                   help="keep glibc's default allocator settings (see docs/benchmarks.md)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--coordinator", default=os.environ.get("JAXCOLL_COORDINATOR"))
    p.add_argument("--num-processes", type=int,
                   default=int(os.environ.get("JAXCOLL_NUM_PROCESSES", "1")))
    p.add_argument("--process-id", type=int, default=int(os.environ.get("JAXCOLL_PROCESS_ID", "0")))
    a = p.parse_args(argv)
    a.ops = list(OPS) if a.ops == "all" else [o.strip() for o in a.ops.split(",") if o.strip()]
    a.algorithms = [s.strip() for s in a.algorithms.split(",") if s.strip()]
    for o in a.ops:
        if o not in OPS:
            p.error(f"--ops: {o!r} is not one of {', '.join(OPS)}")
    for s in a.algorithms:
        if s not in ALGS + ("auto",):
            p.error(f"--algorithms: {s!r} is not one of {', '.join(ALGS)}, auto")
    if a.min_bytes > a.max_bytes:
        p.error(f"--min-bytes {a.min_bytes} is larger than --max-bytes {a.max_bytes}")
    return a


def malloc_tune() -> bool:
    """Keep freed memory in glibc's heap instead of returning it to the OS (mmap/munmap).

    XLA on CPU allocates a fresh buffer per op; with glibc's defaults, every buffer above the
    mmap threshold is a new mapping whose pages fault in on first touch. Measured here that
    doubles the time of large collectives (see docs/benchmarks.md). Returns whether it applied.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        m_trim, m_top_pad, m_mmap = -1, -2, -3
        ok = libc.mallopt(m_mmap, 1 << 30) and libc.mallopt(m_trim, 1 << 31)
        return bool(ok and libc.mallopt(m_top_pad, 256 << 20))
    except (OSError, AttributeError):
        return False


def memcpy_gbps(nbytes: int = 64 << 20, iters: int = 7) -> float:
    """Median copy bandwidth of one core, counting read + write, in GB/s."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(times)) / 1e9


def _init_jax(a: argparse.Namespace):
    import jax

    if a.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.config.update("jax_num_cpu_devices", a.devices)
    except RuntimeError:
        pass  # the backend is already up (e.g. inside tests): use the devices it has
    if a.num_processes > 1 and not jax.distributed.is_initialized():
        if not a.coordinator:
            raise SystemExit("jaxcoll-bench: --num-processes > 1 needs --coordinator HOST:PORT")
        jax.distributed.initialize(a.coordinator, num_processes=a.num_processes,
                                   process_id=a.process_id)
    return jax


def _mesh(jax, a):
    from jax.sharding import Mesh

    devs = np.array(jax.devices())
    if a.mesh:
        outer, inner = (int(v) for v in a.mesh.lower().split("x"))
    elif jax.process_count() > 1:
        outer, inner = jax.process_count(), jax.local_device_count()
    else:
        return Mesh(devs, ("x",)), "x"
    if outer * inner > devs.size:
        raise SystemExit(f"jaxcoll-bench: --mesh {a.mesh} needs {outer * inner} devices, "
                         f"{devs.size} available")
    return Mesh(devs[: outer * inner].reshape(outer, inner), ("outer", "inner")), ("outer", "inner")


def _case(jax, mesh, axis, op: str, algorithm: str, count: int, dtype):
    """Build (jitted fn, global input, per-rank oracle(r) -> expected local output)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcoll.primitives as C

    n = mesh.devices.size
    spec = P(axis)
    root = n - 1
    # Small integers: sums are exact in every float dtype, so #wrong counts real errors.
    base = (np.arange(count) % 7).astype(dtype)
    rows = np.stack([base + np.asarray(r % 5, dtype) for r in range(n)])
    if op == "all_reduce":
        body = lambda v: C.all_reduce(v, axis, algorithm=algorithm)  # noqa: E731
        want = lambda r: rows.sum(0, dtype=np.float64)  # noqa: E731
    elif op == "reduce":
        body = lambda v: C.reduce(v, axis, root, algorithm=algorithm)  # noqa: E731
        want = lambda r: rows.sum(0, dtype=np.float64) if r == root else rows[r]  # noqa: E731
    elif op == "broadcast":
        body = lambda v: C.broadcast(v, axis, root, algorithm=algorithm)  # noqa: E731
        want = lambda r: rows[root]  # noqa: E731
    elif op == "all_gather":
        body = lambda v: C.all_gather(v, axis, tiled=True, algorithm=algorithm)  # noqa: E731
        want = lambda r: rows.reshape(-1)  # noqa: E731
    else:  # reduce_scatter: count is the per-rank input, n slices of count / n
        body = lambda v: C.reduce_scatter(v, axis, tiled=True, algorithm=algorithm)  # noqa: E731
        m = count // n
        want = lambda r: rows.sum(0, dtype=np.float64)[r * m:(r + 1) * m]  # noqa: E731

    f = jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=spec,
                              out_specs=spec))
    sharding = NamedSharding(mesh, spec)
    x = jax.make_array_from_callback(rows.shape, sharding, lambda idx: rows[idx])
    del jnp
    return f, x, want


def _wrong(out, want) -> int:
    bad = 0
    for shard in out.addressable_shards:
        r = shard.index[0].start or 0
        got = np.asarray(shard.data)[0].astype(np.float64)
        bad += int(np.sum(got != np.asarray(want(r), np.float64)))
    return bad


def _time(f, x, iters: int, warmup: int, jax) -> tuple[float, object]:
    out = None
    for _ in range(max(1, warmup)):
        out = f(x)
        out.block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        out = f(x)
        out.block_until_ready()
        times.append(time.perf_counter() - t)
    if jax.process_count() > 1:  # every process reports the slowest one's median
        from jax.experimental import multihost_utils

        med = np.asarray(multihost_utils.process_allgather(np.float64(np.median(times))))
        return float(med.max()), out
    return float(np.median(times)), out


def run(a: argparse.Namespace) -> list[dict]:
    """Run the benchmark; return one dict per row (and print them on process 0)."""
    tuned = False if a.no_malloc_tune else malloc_tune()
    jax = _init_jax(a)
    lead = jax.process_index() == 0
    mesh, axis = _mesh(jax, a)
    n = mesh.devices.size
    dtype = np.dtype(a.dtype)
    sizes = []
    s = a.min_bytes
    while s <= a.max_bytes:
        sizes.append(s)
        s *= 2
    jobs = [(op, alg, size) for op in a.ops for alg in a.algorithms for size in sizes
            if not (alg == "hierarchical" and axis == "x")]
    skipped = [alg for alg in a.algorithms if alg == "hierarchical" and axis == "x"]
    if lead:
        print(f"# jaxcoll-bench  jax {jax.__version__}  backend {jax.default_backend()}  "
              f"devices {n} ({jax.process_count()} process(es))  mesh "
              f"{dict(zip(mesh.axis_names, mesh.devices.shape))}  dtype {dtype.name}")
        print(f"# memory copy bandwidth (1 core, read+write): {memcpy_gbps():.1f} GB/s  "
              f"(the ceiling for busbw with simulated devices)  malloc-tune: "
              f"{'on' if tuned else 'off'}")
        if skipped:
            print("# hierarchical skipped: it needs a 2-D mesh (--mesh OUTERxINNER)")
        print(f"# {'op':<15}{'algorithm':<13}{'size':>8}{'count':>11}{'dtype':>9}"
              f"{'time(us)':>12}{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}{'#wrong':>8}", flush=True)
    bar = None
    if lead and not a.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), file=sys.stderr, leave=False, unit="row")
        except ImportError:
            bar = None
    rows = []
    for op, alg, size in jobs:
        count = max(n, size // dtype.itemsize)
        per_rank = count // n if op == "all_gather" else count
        if op in ("all_gather", "reduce_scatter"):
            count = per_rank * n if op == "all_gather" else max(n, count // n * n)
        f, x, want = _case(jax, mesh, axis, op, alg, per_rank if op == "all_gather" else count,
                           dtype)
        t, out = _time(f, x, a.iters, a.warmup, jax)
        wrong = _wrong(out, want)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            wrong = int(np.asarray(multihost_utils.process_allgather(np.int64(wrong))).sum())
        nbytes = count * dtype.itemsize
        algbw = nbytes / t / 1e9
        row = {"op": op, "algorithm": alg, "bytes": nbytes, "count": count, "dtype": dtype.name,
               "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * FACTORS[op](n),
               "wrong": wrong, "devices": n}
        rows.append(row)
        if bar is not None:
            bar.update(1)
        if lead:
            line = (f"  {op:<15}{alg:<13}{human(nbytes):>8}{count:>11}{dtype.name:>9}"
                    f"{row['time_us']:>12.1f}{algbw:>13.3f}{row['busbw']:>13.3f}{wrong:>8}")
            (bar.write(line, file=sys.stdout) if bar is not None else print(line, flush=True))
    if bar is not None:
        bar.close()
    return rows


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows}, key=OPS.index)
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for alg in dict.fromkeys(r["algorithm"] for r in rows if r["op"] == op):
            pts = [(r["bytes"], r["busbw"]) for r in rows
                   if r["op"] == op and r["algorithm"] == alg]
            ax.plot(*zip(*pts), marker="o", label=alg)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{op}, {rows[0]['devices']} devices")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _update_table(rows: list[dict], jax) -> str:
    from jaxcoll.algorithms import _table, table_from_results
    from jaxcoll.algorithms.auto import topology

    platform, topo = jax.default_backend(), topology()
    table = {k: dict(v) for k, v in _table.TABLE.items()}
    new = table_from_results(rows, platform=platform, topo=topo)
    table.setdefault(platform, {}).setdefault(topo, {}).update(new[platform][topo])
    path = _table.__file__
    head = open(path).read().split("TABLE = ")[0]
    with open(path, "w") as fh:
        fh.write(head + "TABLE = " + _pformat(table) + "\n")
    return path


def _pformat(obj, indent: int = 0) -> str:
    pad = " " * (indent + 4)
    if isinstance(obj, dict):
        inner = "".join(f"{pad}{k!r}: {_pformat(v, indent + 4)},\n" for k, v in obj.items())
        return "{\n" + inner + " " * indent + "}"
    if isinstance(obj, list):
        return "[" + ", ".join(repr(tuple(e)) for e in obj) + "]"
    return repr(obj)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``jaxcoll-bench`` and ``python -m jaxcoll.bench``; returns the exit code
    (1 if any result was wrong)."""
    a = _args(argv)
    rows = run(a)
    import jax

    if jax.process_index() == 0:
        if a.csv:
            with open(a.csv, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        if a.plot:
            _plot(rows, a.plot)
        if a.update_table:
            path = _update_table(rows, jax)
            print(f"# wrote the auto table for {jax.default_backend()} to {path}")
        print(f"# {sum(r['wrong'] for r in rows)} wrong elements in {len(rows)} rows")
    return 1 if any(r["wrong"] for r in rows) else 0
