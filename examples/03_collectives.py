"""Seed 003: the torch.distributed communication primitives, one by one, in jaxcoll.

broadcast, all_reduce, reduce, scatter, gather, all_gather and send/recv over 4 ranks, with the
same data as the tutorial. Each is an SPMD function: one program, every rank runs it on its own
row, and row r of the result is what rank r would hold after the torch call.

The second half repeats them with ``jaxcoll.distributed`` (torch-style eager calls on per-rank
arrays, printed as "dist: rank r ..."), ending with the async all_reduce: issue it with
``async_op=True``, compute something else, then ``wait()``.

Run:  python examples/03_collectives.py        (simulates 4 CPU devices; takes a few seconds)
"""

import os

WORLD = 4
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={WORLD}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll.primitives as C  # noqa: E402
from jaxcoll import distributed as dist  # noqa: E402

mesh = jax.make_mesh((WORLD,), ("rank",))


def spmd(fn):
    """Run ``fn`` on every rank: its argument and result are that rank's row."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("rank"), out_specs=P("rank")))


def rows(values, dtype=np.float32):
    """One row per rank, row r on rank r's device."""
    return jax.device_put(np.asarray(values, dtype), NamedSharding(mesh, P("rank")))


def each(label, result):
    for r, row in enumerate(np.asarray(result)):
        print(f"Rank {r} {label}: {row.tolist()}")


# broadcast: zeros everywhere, rank 0 holds 1; afterwards every rank has 1.
tensor = rows([[1.0 if r == 0 else 0.0] for r in range(WORLD)])
each("has data after broadcast", spmd(lambda t: C.broadcast(t, "rank", src=0))(tensor))

# all_reduce: rank r holds r + 1; SUM gives 1 + 2 + 3 + 4 = 10 on every rank.
tensor = rows([[r + 1.0] for r in range(WORLD)])
each("initial tensor", tensor)
each("final tensor after all_reduce", spmd(lambda t: C.all_reduce(t, "rank", op="sum"))(tensor))

# reduce: only dst=0 receives the SUM; other ranks keep their own tensor.
each("after reduce(dst=0)", spmd(lambda t: C.reduce(t, "rank", dst=0))(tensor))

# scatter: rank 0's scatter_list [1, 2, 3, 4] (one entry per rank); rank i receives i + 1.
# Every rank passes an array of the same shape (SPMD); only src's is read.
scatter_list = rows([[1.0, 2.0, 3.0, 4.0] if r == 0 else [0.0] * WORLD for r in range(WORLD)])
each(
    "received tensor after scatter",
    spmd(lambda t: C.scatter(t[0], "rank", src=0, tiled=True)[None])(scatter_list),
)

# gather: every rank sends rank + 1 to dst=0, which gets [1, 2, 3, 4] in rank order.
# (Other ranks get zeros of the same shape: under SPMD every rank's result has one shape.)
each(
    "gather list after gather(dst=0)",
    spmd(lambda t: C.gather(t, "rank", dst=0, tiled=True)[None])(tensor),
)

# all_gather: every rank gets the list.
each("list after all_gather", spmd(lambda t: C.all_gather(t, "rank", tiled=True)[None])(tensor))

# send/recv: rank 0 sends its tensor to rank 1 (rank 1's "recv"); everyone else keeps theirs.
# One call holds every (src, dst) pair, so there is no send/recv ordering to deadlock on.
payload = rows([[42.0] if r == 0 else [-1.0] for r in range(WORLD)])
each("after send(0 -> 1)/recv", spmd(lambda t: C.sendrecv(t, "rank", [(0, 1)]))(payload))

# a ring: every rank sends to the next one (isend/irecv around a ring, all at once).
each("after a ring shift", spmd(lambda t: C.shift(t, "rank", offset=1))(tensor))

# PRODUCT and MAX (ops lax has no or a different collective for) work the same way.
each("after all_reduce(PRODUCT)", spmd(lambda t: C.all_reduce(t, "rank", op="product"))(tensor))
each(
    "after all_reduce(BXOR) of rank+1 as int",
    spmd(lambda t: C.all_reduce(t.astype(jnp.int32), "rank", op="bxor"))(tensor),
)


# ---- The same calls with jaxcoll.distributed: no shard_map; row r of each array is rank r's
# tensor.
def show(label, x):
    for r, row in enumerate(dist.to_ranks(x)):
        print(f"dist: rank {r} {label}: {row.tolist()}")


t = dist.per_rank(lambda r: np.float32([r + 1.0]))  # rank r holds r + 1
show("broadcast(src=0)", dist.broadcast(dist.per_rank(lambda r: np.float32([r == 0])), src=0))
show("all_reduce", dist.all_reduce(t, op=dist.ReduceOp.SUM))
show("reduce(dst=0)", dist.reduce(t, dst=0))
lists = dist.per_rank(lambda r: np.float32([1, 2, 3, 4]) * (r == 0))  # only src's row is read
show("scatter(src=0)", dist.scatter(lists, src=0, tiled=True))
show("gather(dst=0)", dist.gather(t, dst=0, tiled=True))
show("all_gather", dist.all_gather(t, tiled=True))
show(
    "send(0 -> 1)",
    dist.send(dist.per_rank(lambda r: np.float32([42.0 if r == 0 else -1.0])), dst=1, src=0),
)
show("ring sendrecv", dist.sendrecv(t, [(r, (r + 1) % WORLD) for r in range(WORLD)]))

# With a group, as torch: new_group sorts its ranks, src=/dst= are GLOBAL ranks and
# group_src=/group_dst= ranks within the group. Row j is group rank j.
pair = dist.new_group([3, 1])  # group ranks 0, 1 = global 1, 3
tp = dist.per_rank(lambda j: np.float32([pair.ranks[j] + 1.0]), pair)  # global rank + 1
show("group [1, 3] broadcast(src=3)", dist.broadcast(tp, src=3, group=pair))
show("group [1, 3] reduce(group_dst=0)", dist.reduce(tp, group=pair, group_dst=0))

# async: issue the all_reduce, compute something else while it runs, then wait().
work = dist.all_reduce(t, async_op=True)  # returns at once, like torch's Work
other = jnp.linalg.norm(jnp.ones((256, 256)) @ jnp.ones((256, 256)))  # overlaps the collective
result = work.wait()  # blocks until every rank's result is ready
print(f"dist: other work while all_reduce ran: {float(other):.1f}")
show("async all_reduce after wait()", result)
