"""Seed 000: "Why do values increase after all_reduce?", ported to jaxcoll.

all_reduce *combines* every rank's value (SUM by default) and gives every rank the result, so a
rank that started with 1.0 ends with the sum over all ranks. Three cases, as in the original:
a scalar per rank, a 3x3 tensor per rank, and MAX instead of SUM. Two ranks, as in the seed.

The same three cases follow in the ``jaxcoll.distributed`` form (torch-style eager calls on per-rank
arrays, no shard_map to write), printed as "dist: rank r ...".

Run:  python examples/01_all_reduce.py        (simulates 2 CPU devices; takes a few seconds)
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
from jaxcoll import ReduceOp  # noqa: E402
from jaxcoll import distributed as dist  # noqa: E402

# A rank is a device position along the mesh axis "rank".
mesh = jax.make_mesh((WORLD,), ("rank",))


def per_rank(rows):
    """Place row r of ``rows`` on the device of rank r."""
    return jax.device_put(np.asarray(rows), NamedSharding(mesh, P("rank")))


def show(label, stage, rows):
    """Print each rank's row, as each torch process prints its own tensor."""
    for r in range(WORLD):
        print(f"Rank {r}: {stage} {label} = {np.asarray(rows)[r].tolist()}")


# Example 1: one scalar per rank, value = rank + 1.
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=P("rank"), out_specs=P("rank"))
def sum_all(value):
    # Inside shard_map each rank sees its own row (leading axis of size 1); all_reduce returns
    # a NEW array holding the sum. The input is not modified.
    return C.all_reduce(value, "rank", op=ReduceOp.SUM)


values = per_rank([[r + 1.0] for r in range(WORLD)])
show("all_reduce - Value", "Before", values)
show("all_reduce - Value", "After", sum_all(values))

# Example 2: a 3x3 tensor per rank, ones * (rank + 1); the sum is element-wise.
tensors = per_rank([np.ones((3, 3)) * (r + 1) for r in range(WORLD)])
show("all_reduce - Tensor", "Before", tensors)
show("all_reduce - Tensor", "After", sum_all(tensors))


# Example 3: MAX instead of SUM: values can grow (or shrink) with any reduce op.
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=P("rank"), out_specs=P("rank"))
def max_all(t):
    return C.all_reduce(t, "rank", op="max")


maxes = per_rank([np.array([1.0, 2.0, 3.0]) * (r + 1) for r in range(WORLD)])
show("all_reduce(MAX) - Tensor", "Before", maxes)
show("all_reduce(MAX) - Tensor", "After", max_all(maxes))


# The same with jaxcoll.distributed: each call is torch's dist.all_reduce on a per-rank array (row r
# lives on rank r's device); it returns a new per-rank array instead of reducing in place.
def show_dist(label, x):
    for r, row in enumerate(dist.to_ranks(x)):
        print(f"dist: rank {r} {label} = {row.tolist()}")


show_dist("all_reduce value", dist.all_reduce(dist.per_rank(lambda r: np.float32([r + 1.0]))))
show_dist(
    "all_reduce tensor",
    dist.all_reduce(dist.per_rank(lambda r: np.ones((3, 3), np.float32) * (r + 1))),
)
show_dist(
    "all_reduce(MAX) tensor",
    dist.all_reduce(
        dist.per_rank(lambda r: np.float32([1.0, 2.0, 3.0]) * (r + 1)), op=dist.ReduceOp.MAX
    ),
)
