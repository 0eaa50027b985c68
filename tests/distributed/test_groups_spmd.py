"""Groups as ``axis_name`` of the primitives inside a user's own shard_map.

Members must get the group result (the NumPy oracle on the members' inputs, in group order);
non-members keep their input, or get zeros where the result has another shape. One jitted
program per group computes every op.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcoll.primitives as C
from jaxcoll import distributed as dist
from tests.helpers import mesh_1d, mesh_2d, run_per_rank
from tests.primitives import oracle

# name -> (group factory, mesh factory, member positions per subgroup in group order)
CASES = {
    "world": (lambda: dist.world(), lambda: mesh_1d(8), [list(range(8))]),
    "size1": (lambda: dist.new_group([2]), lambda: mesh_1d(8), [[2]]),
    "size3": (lambda: dist.new_group([1, 5, 6]), lambda: mesh_1d(8), [[1, 5, 6]]),
    "size4": (lambda: dist.new_group([6, 0, 3, 4]), lambda: mesh_1d(8), [[0, 3, 4, 6]]),
    "ordered4": (lambda: dist.ordered_group([6, 0, 3, 4]), lambda: mesh_1d(8), [[6, 0, 3, 4]]),
    "sub2": (lambda: dist.new_subgroups(2), lambda: mesh_1d(8), [[0, 1], [2, 3], [4, 5], [6, 7]]),
    "node": (
        lambda: dist.hierarchy(4).node,
        lambda: mesh_2d(2, 4),
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    "local": (lambda: dist.hierarchy(4).local, lambda: mesh_2d(2, 4), [[0, 1, 2, 3], [4, 5, 6, 7]]),
}


def body_for(g, k):
    src, dst = k - 1, 0

    def body(f, i):
        pairs = [(j, (j + 1) % k) for j in range(k)] if k > 1 else []
        return {
            "sum": C.all_reduce(f, g),
            "max_i": C.all_reduce(i, g, op="max"),
            "prod": C.all_reduce(f, g, op="product"),
            "bxor": C.all_reduce(i, g, op="bxor"),
            "reduce": C.reduce(f, g, dst=dst),
            "broadcast": C.broadcast(f, g, src=src),
            "all_gather": C.all_gather(f, g),
            "gather": C.gather(f, g, dst=dst),
            "scatter": C.scatter(f, g, src=src),
            "reduce_scatter": C.reduce_scatter(f, g, op="max"),
            "all_to_all": C.all_to_all(f, g, 0, 1),
            "sendrecv": C.sendrecv(f, g, pairs),
            "shift": C.shift(i, g, offset=-1),
            "rank": C.rank(g),
            "size": jnp.full((), C.world_size(g), jnp.int32),
        }

    return body


@pytest.mark.parametrize("name", list(CASES))
def test_group_as_axis_name(name: str) -> None:
    make_group, make_mesh, subs = CASES[name]
    g, mesh = make_group(), make_mesh()
    n, k = mesh.devices.size, g.size
    rng = np.random.default_rng(7)
    f = (rng.uniform(0.5, 1.5, (n, k, 3)) * rng.choice([-1.0, 1.0], (n, k, 3))).astype(np.float32)
    i = rng.integers(-4, 5, (n, k, 3)).astype(np.int32)
    got = run_per_rank(body_for(g, k), mesh, [f, i], jit=True)
    src, dst = k - 1, 0
    pairs = [(j, (j + 1) % k) for j in range(k)] if k > 1 else []
    o = oracle
    want_fn = {
        "sum": (f, lambda xs: o.all_reduce(xs, "sum")),
        "max_i": (i, lambda xs: o.all_reduce(xs, "max")),
        "prod": (f, lambda xs: o.all_reduce(xs, "product")),
        "bxor": (i, lambda xs: o.all_reduce(xs, "bxor")),
        "reduce": (f, lambda xs: o.reduce(xs, "sum", dst)),
        "broadcast": (f, lambda xs: o.broadcast(xs, src)),
        "all_gather": (f, lambda xs: o.all_gather(xs, False)),
        "gather": (f, lambda xs: o.gather(xs, dst)),
        "scatter": (f, lambda xs: o.scatter(xs, src, False)),
        "reduce_scatter": (f, lambda xs: o.reduce_scatter(xs, "max", False)),
        "all_to_all": (f, lambda xs: o.all_to_all_untiled(xs, 0, 1)),
        "sendrecv": (f, lambda xs: o.sendrecv(xs, pairs)),
        "shift": (i, lambda xs: o.shift(xs, -1)),
        "rank": (None, lambda xs: [np.int32(j) for j in range(len(xs))]),
        "size": (None, lambda xs: [np.int32(k)] * len(xs)),
    }
    members = {p for sub in subs for p in sub}
    for key, (x, fn) in want_fn.items():
        xs = x if x is not None else np.zeros(n)
        want = [None] * n
        for sub in subs:
            for p, y in zip(sub, fn([xs[p] for p in sub]), strict=True):
                want[p] = y
        for p in range(n):
            if p in members:
                w = want[p]
            elif key == "rank":
                w = np.int32(-1)
            elif key == "size":
                w = np.int32(k)
            elif np.shape(got[key][p]) == x.shape[1:]:
                w = x[p]  # non-members keep their input
            else:
                w = np.zeros_like(got[key][p])
            np.testing.assert_allclose(
                got[key][p], w, rtol=1e-5, atol=1e-6, err_msg=f"{key} on {name}, rank {p}"
            )


def test_group_larger_than_axis_is_rejected() -> None:
    g = dist.new_group([1, 5, 6])
    with pytest.raises(ValueError, match=r"all_reduce: the group .* names rank 6, but axis 'x'"):
        run_per_rank(lambda v: C.all_reduce(v, g), mesh_1d(4), [np.zeros((4, 2), np.float32)])


def test_group_bad_root_is_rejected() -> None:
    g = dist.new_group([1, 5, 6])
    with pytest.raises(ValueError, match=r"broadcast: src=3 is out of range for a group of 3"):
        run_per_rank(lambda v: C.broadcast(v, g, src=3), mesh_1d(8), [np.zeros((8, 2))])
