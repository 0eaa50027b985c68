"""Each step of making the ring all-reduce fast, side by side with native psum (8 CPU devices).

Variants: ``straightforward`` (dynamic-update-slice of the running buffer at every step),
``acc+roll`` (running partial sum, no in-place updates in the reduce-scatter; the all-gather
stacks the chunks and rotates them by the rank at the end), and jaxcoll's ``ring`` (running
partial sum; the all-gather writes each chunk once, in place). Run::

    .venv/bin/python benchmarks/ring_variants.py            # glibc malloc tuned (as the bench)
    .venv/bin/python benchmarks/ring_variants.py --no-malloc-tune
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from jaxcoll.bench import malloc_tune  # noqa: E402

TUNED = "--no-malloc-tune" not in sys.argv and malloc_tune()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll.primitives as C  # noqa: E402

N = 8
RIGHT = [(i, (i + 1) % N) for i in range(N)]


def straightforward(x):
    r = lax.axis_index("x")
    rows = x.reshape(N, -1)
    for s in range(N - 1):
        send = lax.dynamic_index_in_dim(rows, (r - s) % N, keepdims=False)
        recv = lax.ppermute(send, "x", RIGHT)
        idx = (r - s - 1) % N
        cur = lax.dynamic_index_in_dim(rows, idx, keepdims=False)
        rows = lax.dynamic_update_index_in_dim(rows, cur + recv, idx, 0)
    for s in range(N - 1):
        send = lax.dynamic_index_in_dim(rows, (r + 1 - s) % N, keepdims=False)
        recv = lax.ppermute(send, "x", RIGHT)
        rows = lax.dynamic_update_index_in_dim(rows, recv, (r - s) % N, 0)
    return rows.reshape(x.shape)


def acc_roll(x):
    r = lax.axis_index("x")
    rows = x.reshape(N, -1)
    acc = lax.dynamic_index_in_dim(rows, (r - 1) % N, keepdims=False)
    for s in range(N - 1):
        acc = lax.ppermute(acc, "x", RIGHT) + lax.dynamic_index_in_dim(
            rows, (r - 2 - s) % N, keepdims=False
        )
    got, cur = [acc], acc
    for _ in range(N - 1):
        cur = lax.ppermute(cur, "x", RIGHT)
        got.append(cur)
    stacked = jnp.stack(got[::-1])
    both = jnp.concatenate([stacked, stacked])
    return lax.dynamic_slice_in_dim(both, (N - r - 1) % N, N, 0).reshape(x.shape)


VARIANTS = {
    "native psum": lambda v: lax.psum(v, "x"),
    "straightforward": straightforward,
    "acc+roll": acc_roll,
    "jaxcoll ring": lambda v: C.all_reduce(v, "x", algorithm="ring"),
}


def main() -> None:
    mesh = Mesh(np.array(jax.devices()[:N]), ("x",))
    tuned = "on" if TUNED else "off"
    print(f"# 8 simulated CPU devices, float32, median of 7, malloc-tune {tuned}")
    print(f"{'size/rank':>10}" + "".join(f"{k:>17}" for k in VARIANTS) + f"{'ring/native':>13}")
    for nbytes in (4 << 10, 1 << 20, 16 << 20):
        xs = np.random.default_rng(0).integers(0, 5, (N, nbytes // 4)).astype(np.float32)
        xa = jax.device_put(xs.reshape(-1), NamedSharding(mesh, P("x")))
        times = []
        for fn in VARIANTS.values():
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            out = np.asarray(f(xa)).reshape(N, -1)
            assert np.array_equal(out, np.broadcast_to(xs.sum(0), out.shape))
            ts = []
            for _ in range(7):
                t = time.perf_counter()
                f(xa).block_until_ready()
                ts.append(time.perf_counter() - t)
            times.append(np.median(ts) * 1e3)
        print(
            f"{nbytes >> 10:>8}K"
            + "".join(f"{t:>14.2f} ms" for t in times)
            + f"{times[-1] / times[0]:>12.1f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
