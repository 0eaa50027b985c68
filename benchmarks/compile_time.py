"""Compile time of each algorithm against the number of devices (goal: n=128 within 2x of n=8).

For every algorithm/op below and every device count n, it times
``jax.jit(f).lower(x).compile()`` of ``f = jax.jit(jax.shard_map(lambda v: op(v, axis,
algorithm=A), ...))`` on 1024 float32 elements per rank: a fresh function each time, so
nothing comes from a cache, median of ``--repeats`` (default 3), after one untimed compile of
every case (one-time costs: starting the backend, first use of each code path). Each n runs
in its own subprocess, since the simulated CPU device count
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``) is fixed before JAX starts.
``hierarchical`` runs on a 2-D mesh ``(n/4, 4)`` with ``axis_name=("outer", "inner")``; the
others on a 1-D mesh.

Prints one row per algorithm/op, one column per n (seconds) and the ratio of the largest n to
the smallest; ``--hlo`` adds the instruction count of each compiled module.

Usage::

    python benchmarks/compile_time.py                            # this checkout's jaxcoll
    python benchmarks/compile_time.py --jaxcoll-path /tmp/base   # another checkout's
    python benchmarks/compile_time.py --devices 8,16 --repeats 1 --hlo

Takes a few minutes on 2 cores (most of it n=128).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (row label, primitive, algorithm); every primitive is called as op(v, axis, algorithm=A).
CASES = [
    ("all_reduce native", "all_reduce", "native"),
    ("all_reduce ring", "all_reduce", "ring"),
    ("all_reduce tree", "all_reduce", "tree"),
    ("all_reduce hierarchical", "all_reduce", "hierarchical"),
    ("all_gather ring", "all_gather", "ring"),
    ("all_gather tree", "all_gather", "tree"),
    ("broadcast ring", "broadcast", "ring"),
    ("broadcast tree", "broadcast", "tree"),
]
COUNT = 1024  # float32 elements per rank
INNER = 4  # hierarchical: mesh (n / INNER, INNER)
HERE = Path(__file__).resolve().parent


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="8,32,64,128", help="comma list of device counts")
    p.add_argument("--repeats", type=int, default=3, help="compiles per case (median)")
    p.add_argument(
        "--jaxcoll-path",
        default=str(HERE.parent),
        metavar="DIR",
        help="put DIR first on the subprocesses' PYTHONPATH (default: this checkout)",
    )
    p.add_argument("--hlo", action="store_true", help="also print HLO instruction counts")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.devices = [int(v) for v in a.devices.split(",") if v.strip()]
    for n in a.devices:
        if n < INNER or n % INNER:
            p.error(f"--devices: {n} is not a multiple of {INNER} (hierarchical's inner axis)")
    return a


def worker(n: int, repeats: int) -> dict:
    """In a process with n devices: {label: (median seconds, HLO instructions)}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcoll
    import jaxcoll.primitives as C

    devices = np.array(jax.devices())
    if devices.size != n:
        raise SystemExit(f"compile_time: expected {n} CPU devices, JAX has {devices.size}")
    flat = Mesh(devices, ("x",))
    grid = Mesh(devices.reshape(n // INNER, INNER), ("outer", "inner"))

    def compile_once(op: str, algorithm: str):
        mesh, axis = (grid, ("outer", "inner")) if algorithm == "hierarchical" else (flat, "x")
        if op == "broadcast":
            body = lambda v: C.broadcast(v, axis, 0, algorithm=algorithm)  # noqa: E731
        else:
            body = lambda v: getattr(C, op)(v, axis, algorithm=algorithm)  # noqa: E731
        spec = P(axis)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        x = jax.ShapeDtypeStruct((n * COUNT,), jnp.float32, sharding=NamedSharding(mesh, spec))
        t = time.perf_counter()
        compiled = f.lower(x).compile()
        return time.perf_counter() - t, compiled

    for _, op, algorithm in CASES:  # untimed: start the backend, import and trace once
        compile_once(op, algorithm)
    out = {"jaxcoll": str(Path(jaxcoll.__file__).parent), "jax": jax.__version__}
    for label, op, algorithm in CASES:
        runs = [compile_once(op, algorithm) for _ in range(repeats)]
        text = runs[-1][1].as_text()
        instructions = sum(1 for line in text.splitlines() if " = " in line)
        out[label] = (statistics.median(t for t, _ in runs), instructions)
    return out


def _spawn(n: int, a: argparse.Namespace) -> dict:
    env = dict(os.environ)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [a.jaxcoll_path, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", str(n), "--repeats", str(a.repeats)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"compile_time: the n={n} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(results: dict[int, dict], column: int, fmt: str) -> str:
    ns = sorted(results)
    lines = [
        "| algorithm/op | " + " | ".join(f"n={n}" for n in ns) + f" | n={ns[-1]} / n={ns[0]} |",
        "|---|" + "---:|" * (len(ns) + 1),
    ]
    for label, _, _ in CASES:
        vals = [results[n][label][column] for n in ns]
        lines.append(
            f"| {label} | "
            + " | ".join(format(v, fmt) for v in vals)
            + f" | {vals[-1] / vals[0]:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _args(argv)
    if a.worker is not None:
        print(json.dumps(worker(a.worker, a.repeats)))
        return 0
    results = {}
    for n in a.devices:
        t = time.perf_counter()
        results[n] = _spawn(n, a)
        print(f"# n={n}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    first = results[a.devices[0]]
    print(
        f"# compile time (s), median of {a.repeats}; jaxcoll from {first['jaxcoll']}, "
        f"jax {first['jax']}, {COUNT} float32 per rank"
    )
    print(_table(results, 0, ".3f"))
    if a.hlo:
        print("\n# instructions in the compiled HLO module")
        print(_table(results, 1, "d"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
