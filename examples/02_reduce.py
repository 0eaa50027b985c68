"""Seed 001: "Why does torch.distributed.reduce affect tensors other than the destination?"

In torch, reduce works in place on buffers, so tensors that share memory with the input (views,
shared storage) or that are touched while an async reduce is in flight can change under you.
jaxcoll's reduce returns a NEW array: rank `dst` gets the reduction, every other rank gets its
own input back, and no other array (x itself, y derived from x) can change. JAX arrays are
immutable, so the seed's three failure modes (in-place update seen through a derived tensor,
shared memory, a race with an async op) cannot happen; this script shows each case.

The ``jaxcoll.distributed`` form of the first and third cases follows (lines "dist: rank r ...").

Run:  python examples/02_reduce.py        (simulates 2 CPU devices; takes a few seconds)
"""

import os

WORLD = 2
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={WORLD}")

from functools import partial  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll.primitives as C  # noqa: E402
from jaxcoll import distributed as dist  # noqa: E402

mesh = jax.make_mesh((WORLD,), ("rank",))


@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=P("rank"), out_specs=P("rank"))
def reduce_to_0(x):
    # dst=0 gets the SUM over ranks; rank 1 gets its own x back, untouched.
    return C.reduce(x, "rank", dst=0, op="sum")


# Example 1: y is derived from x before the reduce (torch: y could see an in-place update).
x = jax.device_put(np.array([[1, 2, 3], [10, 20, 30]], np.int32), NamedSharding(mesh, P("rank")))
y = x + 1
result = reduce_to_0(x)
for r in range(WORLD):
    print(
        f"Rank {r}: x = {np.asarray(x)[r].tolist()}, y = {np.asarray(y)[r].tolist()}, "
        f"reduce result = {np.asarray(result)[r].tolist()}"
    )

# Example 2: host memory shared between two views (the seed's mmap case). The input buffer is
# read, never written: both views still hold the original numbers afterwards.
shared = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]] * WORLD, np.float32)
view_x, view_y = shared[:, :3], shared[:, 3:]
out = reduce_to_0(jax.device_put(view_x, NamedSharding(mesh, P("rank"))))
for r in range(WORLD):
    print(
        f"Rank {r}: shared x = {view_x[r].tolist()}, shared y = {view_y[r].tolist()}, "
        f"reduce result = {np.asarray(out)[r].tolist()}"
    )

# Example 3: the reduce is dispatched asynchronously (JAX dispatch is async) and y is updated
# while it may still be running. There is no race: y + 2 is a new array, x is never written.
pending = reduce_to_0(x)  # returns at once; the collective runs in the background
y = y + 2  # concurrent work on another array
pending.block_until_ready()  # torch: work.wait() / dist.barrier()
for r in range(WORLD):
    print(
        f"Rank {r}: after async reduce x = {np.asarray(x)[r].tolist()}, "
        f"y = {np.asarray(y)[r].tolist()}, reduce result = {np.asarray(pending)[r].tolist()}"
    )

# The same with jaxcoll.distributed: torch's dist.reduce(x, dst=0), on a per-rank array.
dx = dist.per_rank([np.array([1, 2, 3], np.int32), np.array([10, 20, 30], np.int32)])
dy = dx + 1
dres = dist.reduce(dx, dst=0, op=dist.ReduceOp.SUM)
for r in range(WORLD):
    print(
        f"dist: rank {r} x = {dist.to_ranks(dx)[r].tolist()}, "
        f"y = {dist.to_ranks(dy)[r].tolist()}, reduce result = {dist.to_ranks(dres)[r].tolist()}"
    )

# async_op=True returns a Work handle, as in torch; y is updated while the reduce may still run.
work = dist.reduce(dx, dst=0, async_op=True)
dy = dy + 2
dres = work.wait()
for r in range(WORLD):
    print(
        f"dist: rank {r} after async reduce x = {dist.to_ranks(dx)[r].tolist()}, "
        f"y = {dist.to_ranks(dy)[r].tolist()}, reduce result = {dist.to_ranks(dres)[r].tolist()}"
    )
