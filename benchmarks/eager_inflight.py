"""Eager collectives in flight: which bound keeps a loop of dist calls from hanging, at what cost.

Each case runs, in a fresh process with 8 simulated CPU devices, ``--calls`` eager
``dist.all_reduce`` calls of ``--floats`` float32 per rank with no wait between them (torch's
first loop: ``for i in range(n): dist.all_reduce(x)``), then waits for the last result, under
``JAXCOLL_MAX_INFLIGHT=N`` (0: no bound). It prints, per bound, how many runs hung (no result
within ``--timeout`` seconds) and the median time per call of the runs that ended, measured in
interleaved rounds (bound A, bound B, ..., then again) so machine noise hits all alike.

Run:  python benchmarks/eager_inflight.py [--rounds 5] [--calls 120] [--limits 0,2,4,8,16,24,32]
"""

import argparse
import os
import statistics
import subprocess
import sys

CHILD = r"""
import os, sys, time
os.environ["XLA_FLAGS"] = " ".join(__import__("jaxcoll").xla_cpu_flags(devices=8))
os.environ["JAXCOLL_TIMEOUT"] = "0"  # no watchdog: a hang is what is measured
import numpy as np, jax
import jaxcoll.distributed as dist
calls, floats = int(sys.argv[1]), int(sys.argv[2])
x = dist.per_rank(lambda r: np.full((floats,), float(r), np.float32))
jax.block_until_ready(dist.all_reduce(x))  # compiled before the clock starts
t0 = time.perf_counter()
for _ in range(calls):
    y = dist.all_reduce(x)
jax.block_until_ready(y)
print((time.perf_counter() - t0) / calls)
"""


def run(limit: int, calls: int, floats: int, timeout: float) -> float | None:
    env = {**os.environ, "JAXCOLL_MAX_INFLIGHT": str(limit)}
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(calls), str(floats)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        raise RuntimeError(f"JAXCOLL_MAX_INFLIGHT={limit}: exit {out.returncode}\n{out.stderr}")
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=120)
    parser.add_argument("--floats", type=int, default=1_000_000, help="float32 per rank")
    parser.add_argument("--limits", default="0,2,4,8,16,24,32")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before 'hung'")
    args = parser.parse_args()
    limits = [int(v) for v in args.limits.split(",")]
    times: dict[int, list[float]] = {k: [] for k in limits}
    hung = dict.fromkeys(limits, 0)
    for _ in range(args.rounds):
        for k in limits:
            t = run(k, args.calls, args.floats, args.timeout)
            if t is None:
                hung[k] += 1
            else:
                times[k].append(t)
    base = [statistics.median(times[k]) for k in limits if k == 8 and times[k]]
    print(f"{args.calls} eager all_reduce calls of {args.floats} float32 per rank, 8 CPU devices")
    print(f"{'bound':>6} {'hung':>6} {'ms/call':>9} {'vs 8':>7}")
    for k in limits:
        med = statistics.median(times[k]) if times[k] else None
        ms = f"{med * 1e3:9.2f}" if med is not None else f"{'-':>9}"
        ratio = f"{med / base[0]:7.2f}" if med is not None and base else f"{'-':>7}"
        print(f"{k if k else 'none':>6} {hung[k]:>3}/{args.rounds} {ms} {ratio}")


if __name__ == "__main__":
    main()
