"""The benchmark loop: every op x algorithm x size, timed, checked and printed as it goes."""

from __future__ import annotations

import argparse

import jax
import numpy as np

from . import cases, output
from .devices import init_jax, make_mesh, per_process
from .timing import malloc_tune, median_time, memcpy_gbps


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """``min_bytes``, doubling, up to ``max_bytes``."""
    out = []
    while min_bytes <= max_bytes:
        out.append(min_bytes)
        min_bytes *= 2
    return out


def run(a: argparse.Namespace) -> list[dict]:
    """Run the benchmark; return one dict per row (and print them on process 0).

    In a multi-process job every process reports the slowest process's median time and the
    wrong elements of all processes.
    """
    tuned = False if a.no_malloc_tune else malloc_tune()
    init_jax(a)
    lead = jax.process_index() == 0
    mesh, axis = make_mesh(a)
    n = mesh.devices.size
    dtype = np.dtype(a.dtype)
    flat = not isinstance(axis, tuple)  # hierarchical needs a 2-D mesh
    algorithms = [alg for alg in a.algorithms if not (flat and alg == "hierarchical")]
    jobs = [
        (op, alg, size)
        for op in a.ops
        for alg in algorithms
        for size in sizes(a.min_bytes, a.max_bytes)
    ]
    if lead:
        banner = [
            f"jaxcoll-bench  jax {jax.__version__}  backend {jax.default_backend()}  devices {n} "
            f"({jax.process_count()} process(es))  mesh "
            f"{dict(zip(mesh.axis_names, mesh.devices.shape))}  dtype {dtype.name}",
            f"memory copy bandwidth (1 core, read+write): {memcpy_gbps():.1f} GB/s  (the "
            f"ceiling for busbw with simulated devices)  malloc-tune: {'on' if tuned else 'off'}",
        ]
        if len(algorithms) < len(a.algorithms):
            banner.append("hierarchical skipped: it needs a 2-D mesh (--mesh OUTERxINNER)")
        print(output.header(banner), flush=True)
    progress = output.Progress(len(jobs), enabled=lead and not a.no_progress)
    rows = []
    for op, alg, size in jobs:
        case = cases.build(mesh, axis, op, alg, size, dtype)
        seconds, out = median_time(case.fn, case.x, a.iters, a.warmup)
        seconds = float(per_process(np.float64(seconds)).max())
        wrong = int(per_process(np.int64(case.wrong(out))).sum())
        rows.append(case.row(seconds, wrong))
        progress.row(output.format_row(rows[-1]) if lead else None)
    progress.close()
    return rows
