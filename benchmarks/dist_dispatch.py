"""jaxcoll.dist: first-call (trace + compile) time vs cached-call dispatch time, per op.

Every dist collective is a jitted shard_map cached on (op, group, options); jax.jit caches the
compiled program per shape/dtype. This prints, side by side, the first call (which traces and
compiles), the median of the cached calls (dispatch + run, waited on) and their ratio.

Run:  python benchmarks/dist_dispatch.py [--repeats 20]     (simulates 8 CPU devices; ~10 s)
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxcoll import dist  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    sub = dist.new_group([1, 5, 6])
    xw = dist.per_rank(lambda r: np.full((8, 256), r, np.float32))
    xs = dist.per_rank(lambda r: np.full((3, 256), r, np.float32), sub)
    cases = {
        "all_reduce SUM, world": lambda: dist.all_reduce(xw),
        "all_reduce PRODUCT, world": lambda: dist.all_reduce(xw, op="product"),
        "all_reduce SUM, [1,5,6]": lambda: dist.all_reduce(xs, group=sub),
        "broadcast, world": lambda: dist.broadcast(xw, src=3),
        "all_gather, world": lambda: dist.all_gather(xw),
        "reduce_scatter, world": lambda: dist.reduce_scatter(xw),
        "all_to_all, world": lambda: dist.all_to_all(xw),
        "sendrecv ring, world": lambda: dist.sendrecv(xw, [(r, (r + 1) % 8) for r in range(8)]),
    }
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices, rows of 8x256 float32, "
          f"median of {args.repeats} cached calls")
    print(f"{'op':28s} {'first call (ms)':>16s} {'cached (ms)':>12s} {'ratio':>8s}")
    for name, fn in cases.items():
        first = timed(fn)
        cached = statistics.median(timed(fn) for _ in range(args.repeats))
        print(f"{name:28s} {first * 1e3:16.1f} {cached * 1e3:12.3f} {first / cached:8.0f}x")


if __name__ == "__main__":
    main()
