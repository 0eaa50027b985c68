"""Every dist collective against the NumPy oracle, on every group in ``groups.py``, for every
reduce op and every dtype it allows (bool, int32, uint8, float32, bfloat16, complex64; the
data-movement ops on the first four), plain and async; inputs stay bit-identical.

To keep compiles few, each call carries one pytree leaf per dtype (one program per op/group).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcoll import distributed as dist
from tests.distributed.groups import GROUPS, expected
from tests.primitives import oracle

DTYPES = ["bool", "int32", "float32", "complex64"]
EXTRA = ["uint8", "bfloat16"]  # the other dtypes the primitives test, on the reducing ops
ALLOWED = {
    "bool": ["sum", "product", "min", "max", "band", "bor", "bxor"],
    "int32": ["sum", "product", "min", "max", "band", "bor", "bxor"],
    "float32": ["sum", "avg", "product", "min", "max"],
    "complex64": ["sum", "avg", "product"],
}
ALLOWED["uint8"], ALLOWED["bfloat16"] = ALLOWED["int32"], ALLOWED["float32"]
OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]


def make_rows(dtype: str, n: int, k: int, seed: int) -> list[np.ndarray]:
    """n per-rank values of shape (k, 3); products neither overflow nor vanish."""
    rng = np.random.default_rng(seed)
    shape = (n, k, 3)
    if dtype == "bool":
        a = rng.random(shape) < 0.5
    elif dtype in ("int32", "uint8"):
        a = rng.integers(-4 if dtype == "int32" else 0, 5, shape).astype(dtype)
    else:
        a = rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)
        if dtype == "complex64":
            a = a * np.exp(1j * rng.uniform(0, 2 * np.pi, shape))
        a = a.astype(jnp.bfloat16 if dtype == "bfloat16" else dtype)
    return list(a)


def check(got: list[np.ndarray], want: list[np.ndarray], dtype: str, what: str) -> None:
    assert len(got) == len(want), what
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == np.shape(w), f"{what}: row {r} shape {g.shape} != {np.shape(w)}"
        if dtype in ("float32", "complex64", "bfloat16"):
            tol = 3e-2 if dtype == "bfloat16" else 1e-5
            np.testing.assert_allclose(
                np.asarray(g, np.complex128),
                np.asarray(w, np.complex128),
                rtol=tol,
                atol=tol / 10,
                err_msg=f"{what} row {r}",
            )
        else:
            np.testing.assert_array_equal(
                g, np.asarray(w).astype(g.dtype), err_msg=f"{what} row {r}"
            )


def snapshot(tree) -> dict:
    return {k: [row.tobytes() for row in dist.to_ranks(v)] for k, v in tree.items()}


def setup(name: str, dtypes: list[str], seed: int):
    make, rows, _ = GROUPS[name]
    group = make()
    n, k = len(rows) * len(rows[0]), len(rows[0])
    data = {d: make_rows(d, n, k, seed) for d in dtypes}
    x = {d: dist.per_rank(v, group) for d, v in data.items()}
    return group, rows, data, x


def results(out, async_op: bool):
    if async_op:
        assert isinstance(out, dist.Work)
        out = out.wait()
        assert all(leaf.is_ready() for leaf in jax.tree_util.tree_leaves(out))
    return {d: dist.to_ranks(v) for d, v in out.items()}


# The full op matrix on every group; the hierarchy's "local" view (the same lowering as
# "world" and "sub2", over a 2-D mesh) only on two ops, to keep compiles few.
CASES = [(g, op) for g in GROUPS for op in OPS if g != "local" or op in ("sum", "product")]


@pytest.mark.parametrize(("name", "op"), CASES)
def test_reducing_collectives(name: str, op: str) -> None:
    dtypes = [d for d in DTYPES + EXTRA if op in ALLOWED[d]]
    group, rows, data, x = setup(name, dtypes, seed=OPS.index(op))
    before = snapshot(x)
    k = group.size
    dst = k - 1
    for async_op in (False, True):
        calls = {
            "all_reduce": (
                dist.all_reduce(x, op=op, group=group, async_op=async_op),
                lambda xs: oracle.all_reduce(xs, op),
            ),
            "reduce": (
                dist.reduce(x, group_dst=dst, op=op, group=group, async_op=async_op),
                lambda xs: oracle.reduce(xs, op, dst),
            ),
            "reduce_scatter": (
                dist.reduce_scatter(x, op=op, group=group, async_op=async_op),
                lambda xs: oracle.reduce_scatter(xs, op, tiled=False),
            ),
        }
        for what, (out, fn) in calls.items():
            got = results(out, async_op)
            for d in dtypes:
                want = expected(rows, data[d], fn)
                check(got[d], want, d, f"{what}({op}) on {name}, {d}, async={async_op}")
    assert snapshot(x) == before


@pytest.mark.parametrize("name", list(GROUPS))
def test_data_movement(name: str) -> None:
    group, rows, data, x = setup(name, DTYPES, seed=99)
    before = snapshot(x)
    k = group.size
    src, dst = k - 1, 0
    pairs = [(j, (j + 1) % k) for j in range(k)] if k > 1 else []
    o = oracle
    for async_op in (False, True):
        a = {"async_op": async_op, "group": group}
        calls = {
            "broadcast": (dist.broadcast(x, group_src=src, **a), lambda xs: o.broadcast(xs, src)),
            "all_gather": (dist.all_gather(x, **a), lambda xs: o.all_gather(xs, False)),
            "all_gather tiled": (
                dist.all_gather(x, tiled=True, **a),
                lambda xs: o.all_gather(xs, True),
            ),
            "gather": (dist.gather(x, group_dst=dst, **a), lambda xs: o.gather(xs, dst)),
            "scatter": (dist.scatter(x, group_src=src, **a), lambda xs: o.scatter(xs, src, False)),
            "scatter tiled": (
                dist.scatter(x, group_src=src, tiled=True, **a),
                lambda xs: o.scatter(xs, src, True),
            ),
            "all_to_all": (
                dist.all_to_all(x, split_dim=0, concat_dim=1, **a),
                lambda xs: o.all_to_all_untiled(xs, 0, 1),
            ),
            "all_to_all tiled": (
                dist.all_to_all(x, tiled=True, **a),
                lambda xs: o.all_to_all_tiled(xs),
            ),
            "sendrecv": (dist.sendrecv(x, pairs, **a), lambda xs: o.sendrecv(xs, pairs)),
        }
        for what, (out, fn) in calls.items():
            got = results(out, async_op)
            for d in DTYPES:
                check(got[d], expected(rows, data[d], fn), d, f"{what} on {name}, {d}")

    # send / recv / isend / irecv: one pair, the same exchange
    def want_fn(xs):
        return o.sendrecv(xs, [(src, dst)])

    ends = {"group_dst": dst, "group_src": src, "group": group}
    for out in (
        dist.send(x, **ends),
        dist.recv(x, **ends),
        dist.isend(x, **ends).wait(),
        dist.irecv(x, **ends).wait(),
    ):
        got = results(out, False)
        for d in DTYPES:
            check(got[d], expected(rows, data[d], want_fn), d, f"send on {name}, {d}")
    dist.barrier(group)
    assert snapshot(x) == before


@pytest.mark.parametrize("name", list(GROUPS))
def test_rows_live_on_group_devices(name: str) -> None:
    make, rows, devices = GROUPS[name]
    group = make()
    x = dist.per_rank([np.float32(i) for i in range(len(devices))], group)
    for shard in x.addressable_shards:
        row = shard.index[0].start or 0
        assert shard.device == jax.devices()[devices[row]]
        assert float(np.asarray(shard.data)[0]) == row
    assert dist.get_world_size(group) == len(rows[0])
    assert dist.local_ranks(group) == list(range(len(devices)))
