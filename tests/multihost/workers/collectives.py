"""Every primitive and every dist op on the global 8-device world; saves this process's rows.

Run under the launcher, as 1 process x 8 devices or 2 processes x 4 devices::

    python -m jaxcoll.run --nprocs 2 --devices-per-proc 4 tests/multihost/workers/collectives.py OUT

Each process writes ``OUT/p{process_index}.npz``: entry ``"{name}@{row}"`` is global row (rank)
``row`` of result ``name``, for the rows this process holds (``proc/...`` entries are per
process: row = process index). The test merges the files of all
processes and compares 1 x 8 with 2 x 4 and with NumPy.
"""

import os
import sys

import jaxcoll
from jaxcoll import distributed as dist

WORLD = jaxcoll.init()  # before any other JAX call

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import primitives as jp  # noqa: E402

N = 8
ME = jax.process_index()
results: dict[str, np.ndarray] = {}


def inputs():
    """Per-rank inputs, the same global arrays in every layout (one row per rank)."""
    rng = np.random.default_rng(0)
    return {
        "f": rng.standard_normal((N, 8, 3)).astype(np.float32),
        "i": rng.integers(0, 16, (N, 8)).astype(np.int32),
        "b": rng.random((N, 4)) > 0.5,
        "t": rng.standard_normal((N, 24, 2)).astype(np.float32),  # 24 splits 1, 2, 3, 4, 8 ways
    }


def suite(ax, f, i, b):
    """One program: every primitive over axis ``ax`` (a name or a tuple of names)."""
    n = jp.world_size(ax)
    last = n - 1
    out = {
        "rank": jp.rank(ax),
        "ar_sum": jp.all_reduce(f, ax),
        "ar_avg": jp.all_reduce(f, ax, "avg"),
        "ar_max": jp.all_reduce(f, ax, "max"),
        "ar_min": jp.all_reduce(i, ax, "min"),
        "ar_prod": jp.all_reduce(i % 3 + 1, ax, "product"),
        "ar_band": jp.all_reduce(i, ax, "band"),
        "ar_bor": jp.all_reduce(i, ax, "bor"),
        "ar_bxor": jp.all_reduce(i, ax, "bxor"),
        "ar_bool": jp.all_reduce(b, ax, "sum"),
        "ar_ring": jp.all_reduce(f, ax, algorithm="ring"),
        "ar_tree": jp.all_reduce(f, ax, algorithm="tree"),
        "reduce": jp.reduce(f, ax, last, "sum"),
        "bcast": jp.broadcast(f, ax, last),
        "bcast_tree": jp.broadcast(i, ax, 1 % n, algorithm="tree"),
        "all_gather": jp.all_gather(f, ax),
        "all_gather_tiled": jp.all_gather(i, ax, dim=0, tiled=True),
        "gather": jp.gather(f, ax, 1 % n),
        "scatter": jp.scatter(f, ax, last, dim=0, tiled=True),
        "reduce_scatter": jp.reduce_scatter(f, ax, "sum", tiled=True),
        "reduce_scatter_max": jp.reduce_scatter(i, ax, "max", tiled=True),
        "all_to_all": jp.all_to_all(f, ax, 0, 0, tiled=True),
        "sendrecv": jp.sendrecv(f, ax, [(0, last), (last, 0)] if n > 1 else []),
        "shift": jp.shift(i, ax, 1),
    }
    return {k: v[None] for k, v in out.items()}


def run_mesh(tag, mesh, axes):
    """Run :func:`suite` over each axis in ``axes`` of ``mesh`` as one jitted program."""
    names = tuple(mesh.axis_names)
    spec = P(names if len(names) > 1 else names[0])
    sharding = NamedSharding(mesh, spec)
    data = inputs()
    local = [d.id for d in jax.local_devices()]
    # Each process passes only the rows of its own devices (process-local data).
    rows = [k for k, d in enumerate(mesh.devices.reshape(-1)) if d.id in local]
    placed = {k: jax.make_array_from_process_local_data(sharding, v[rows]) for k, v in data.items()}

    def body(f, i, b):
        return {str(ax): suite(ax, f[0], i[0], b[0]) for ax in axes}

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    out = fn(placed["f"], placed["i"], placed["b"])
    for ax_key, per_ax in out.items():
        for name, arr in per_ax.items():
            save(f"{tag}/{ax_key}/{name}", arr)


def save(name, arr):
    """Record the rows of a per-rank array that this process holds."""
    for shard in arr.addressable_shards:
        start = shard.index[0].start or 0
        data = np.asarray(shard.data)
        for k in range(data.shape[0]):
            results[f"{name}@{start + k}"] = data[k]


def run_dist():
    """Every dist op on world, cross-process and in-process groups; to_ranks keeps local rows."""
    x, it, t = inputs()["f"], inputs()["i"], inputs()["t"]
    results[f"proc/world_ranks@{ME}"] = np.asarray(WORLD.ranks)
    groups = {
        "world": dist.world(),
        "span": dist.new_group([1, 5, 6]),  # ranks of both processes
        "inside": dist.new_group([6, 4]),  # ranks of process 1 only in 2 x 4
        "sub4": dist.new_subgroups(4),  # each subgroup inside one process
        "sub2": dist.new_subgroups(2),
    }
    h = dist.hierarchy(4)
    groups["h_node"], groups["h_local"] = h.node, h.local
    for gname, g in groups.items():
        mine = dist.local_ranks(g)
        if not mine:
            continue
        rank_of_row = list(g.ranks) if len(g.ranks) == g.size else list(range(N))
        xs = dist.per_rank(lambda r, m=rank_of_row: x[m[r]], g)
        ints = dist.per_rank(lambda r, m=rank_of_row: it[m[r]], g)
        ts = dist.per_rank(lambda r, m=rank_of_row: t[m[r]], g)
        n = g.size
        ops = {
            "all_reduce": dist.all_reduce(xs, group=g),
            "all_reduce_max": dist.all_reduce(ints, "max", group=g),
            "reduce": dist.reduce(xs, group=g, group_dst=n - 1),
            "broadcast": dist.broadcast(xs, group=g, group_src=n - 1),
            "all_gather": dist.all_gather(xs, group=g),
            "gather": dist.gather(ints, group=g, group_dst=0),
            "scatter": dist.scatter(ts, group=g, group_src=0, tiled=True),
            "reduce_scatter": dist.reduce_scatter(ts, group=g, tiled=True),
            "all_to_all": dist.all_to_all(ts, group=g, tiled=True),
            "sendrecv": dist.sendrecv(ints, [(0, n - 1)], group=g),
            "send": dist.send(xs, group=g, group_dst=n - 1, group_src=0),
            "async_all_reduce": dist.all_reduce(xs, group=g, async_op=True).wait(),
        }
        for opname, y in ops.items():
            held = dist.to_ranks(y)
            if len(held) != len(mine):
                raise AssertionError(f"to_ranks gave {len(held)} rows, local_ranks {mine}")
            for row, value in zip(mine, held, strict=True):
                results[f"dist/{gname}/{opname}@{row}"] = value
    dist.barrier()
    results[f"proc/broadcast_object@{ME}"] = np.asarray(
        dist.broadcast_object({"from": ME, "pad": "x" * (100 * ME)}, src=jax.process_count() - 1)[
            "from"
        ]
    )
    results[f"proc/all_gather_object@{ME}"] = np.asarray(
        [o["p"] for o in dist.all_gather_object({"p": ME, "pad": [0] * ME})]
    )
    results[f"proc/local_ranks_world@{ME}"] = np.asarray(dist.local_ranks())
    run_objects()


def run_objects():
    """torch's object collectives across processes (a rank is a process here)."""
    last = jax.process_count() - 1
    objs = [None, None] if ME != last else [{"from": ME}, "x" * (50 * ME)]
    dist.broadcast_object_list(objs, src=last)
    results[f"proc/broadcast_object_list@{ME}"] = np.asarray([objs[0]["from"], len(objs[1])])
    gathered = [None] * jax.process_count() if ME == last else None
    dist.gather_object({"p": ME}, gathered, dst=last)
    if ME == last:
        results[f"proc/gather_object@{ME}"] = np.asarray([o["p"] for o in gathered])
    out = [None]
    dist.scatter_object_list(
        out, [10 + p for p in range(jax.process_count())] if ME == 0 else None, src=0
    )
    results[f"proc/scatter_object_list@{ME}"] = np.asarray(out[0])
    if jax.process_count() == 2:  # send/recv need a peer: both directions, two in a row
        peer = 1 - ME
        if ME == 0:
            dist.send_object_list([{"n": 1}, ME], dst=peer)
            dist.send_object_list([{"n": 2}, ME], dst=peer)
        got = [None, None]
        first = dist.recv_object_list(got, src=peer) if ME == 1 else None
        if ME == 1:
            order = got[0]["n"]
            dist.recv_object_list(got, src=peer)
            results[f"proc/recv_object_list@{ME}"] = np.asarray([first, order, got[0]["n"]])
            dist.send_object_list(["back"], dst=peer)
        else:
            back = [None]
            results[f"proc/recv_object_list@{ME}"] = np.asarray(
                [dist.recv_object_list(back, src=peer), back[0] == "back"]
            )


def main(out_dir):
    devices = np.array(jax.devices())  # global order: process 0's devices first
    mesh1 = Mesh(devices, ("x",))
    mesh2 = Mesh(devices.reshape(2, 4), ("node", "local"))
    run_mesh("1d", mesh1, ["x"])
    # "node" spans processes in 2 x 4, "local" stays inside one, the tuple covers all 8.
    run_mesh("2d", mesh2, ["node", "local", ("node", "local")])
    run_dist()
    results[f"proc/process_count@{ME}"] = np.asarray(jax.process_count())
    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, f"p{ME}.npz"), **results)
    print(f"process {ME}: saved {len(results)} rows", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
