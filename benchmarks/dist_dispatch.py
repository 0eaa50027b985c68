"""jaxcoll.distributed dispatch cost: first call, cached call, and a pre-jitted shard_map, per op.

Every dist collective is a jitted shard_map cached on (op, group, options); jax.jit caches the
compiled program per shape/dtype. For each op this prints the first call (trace + compile),
then the median of cached dist calls and of the same primitive in a shard_map the user jitted
once, measured interleaved (dist, pre-jitted, dist, pre-jitted, ...) so machine noise hits
both alike, and their ratio: what dist's argument handling costs on top of the collective.

Run:  python benchmarks/dist_dispatch.py [--repeats 200] [--bytes 4096]   (8 CPU devices)
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll.primitives as C  # noqa: E402
from jaxcoll import distributed as dist  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def prejitted(group, body):
    """The user's own form: one jitted shard_map calling the primitive on the group's axis."""
    spec = P(group.mesh_axes)
    return jax.jit(
        jax.shard_map(lambda v: body(v[0])[None], mesh=group.mesh, in_specs=spec, out_specs=spec)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=4096, help="bytes per rank")
    args = parser.parse_args()
    k = args.bytes // 4
    world, sub = dist.world(), dist.new_group([1, 5, 6])
    xw = dist.per_rank(lambda r: np.full((8, k // 8), r, np.float32))
    xs = dist.per_rank(lambda r: np.full((3, k // 3), r, np.float32), sub)
    ring = [(r, (r + 1) % 8) for r in range(8)]
    a = "x"
    cases = {  # name: (dist call, pre-jitted equivalent, its input)
        "all_reduce SUM": (
            lambda: dist.all_reduce(xw),
            prejitted(world, lambda v: C.all_reduce(v, a)),
            xw,
        ),
        "all_reduce PRODUCT": (
            lambda: dist.all_reduce(xw, op="product"),
            prejitted(world, lambda v: C.all_reduce(v, a, "product")),
            xw,
        ),
        "all_reduce SUM, [1,5,6]": (
            lambda: dist.all_reduce(xs, group=sub),
            prejitted(sub, lambda v: C.all_reduce(v, a)),
            xs,
        ),
        "broadcast": (
            lambda: dist.broadcast(xw, src=3),
            prejitted(world, lambda v: C.broadcast(v, a, 3)),
            xw,
        ),
        "all_gather": (
            lambda: dist.all_gather(xw),
            prejitted(world, lambda v: C.all_gather(v, a)),
            xw,
        ),
        "reduce_scatter": (
            lambda: dist.reduce_scatter(xw),
            prejitted(world, lambda v: C.reduce_scatter(v, a)),
            xw,
        ),
        "all_to_all": (
            lambda: dist.all_to_all(xw),
            prejitted(world, lambda v: C.all_to_all(v, a)),
            xw,
        ),
        "scatter": (
            lambda: dist.scatter(xw, src=0),
            prejitted(world, lambda v: C.scatter(v, a, 0)),
            xw,
        ),
        "sendrecv ring": (
            lambda: dist.sendrecv(xw, ring),
            prejitted(world, lambda v: C.sendrecv(v, a, ring)),
            xw,
        ),
    }
    print(
        f"{jax.device_count()} {jax.devices()[0].platform} devices, {args.bytes} bytes per "
        f"rank (float32), medians of {args.repeats} interleaved calls, each waited for"
    )
    print(
        f"{'op':26s} {'first call (ms)':>16s} {'dist (us)':>10s} {'pre-jitted (us)':>16s} "
        f"{'dist/pre':>9s}"
    )
    ratios = []
    for name, (call, pre, x) in cases.items():
        first = timed(call)
        timed(lambda pre=pre, x=x: pre(x))
        d, p = [], []
        for _ in range(args.repeats):
            d.append(timed(call))
            p.append(timed(lambda pre=pre, x=x: pre(x)))
        md, mp = statistics.median(d), statistics.median(p)
        ratios.append(md / mp)
        print(f"{name:26s} {first * 1e3:16.1f} {md * 1e6:10.0f} {mp * 1e6:16.0f} {md / mp:9.2f}")
    print(f"median dist/pre-jitted over ops: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
