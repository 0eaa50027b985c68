"""NaN and float16: the answers torch (and NumPy) give, on every algorithm.

* MIN/MAX propagate NaN like ``jnp.maximum`` / ``np.maximum.reduce`` for every algorithm and
  float dtype (XLA:CPU's own pmax/pmin drop it: 8 ranks with NaN on rank 3 gave 7.).
* float16 SUM/AVG (all_reduce, reduce, reduce_scatter) equal the float32-accumulated sum rounded
  once to float16 (torch's gloo test expectation), for n = 2..8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from jaxcoll import distributed as dist
from tests.helpers import mesh_1d, mesh_2d

FLOATS = [jnp.float32, jnp.float16, jnp.bfloat16]


def _nan_input(dtype, n=8):
    x = np.tile(np.arange(n, dtype=np.float32)[:, None], (1, 4))
    x[3, 0] = np.nan  # one rank, one element
    x[5, 2] = np.nan
    return x.astype(dtype)


@pytest.mark.parametrize("algorithm", ["native", "ring", "tree", "auto", "hierarchical"])
def test_min_max_propagate_nan(algorithm):
    mesh = mesh_2d(2, 4) if algorithm == "hierarchical" else mesh_1d(8)
    axis = ("node", "local") if algorithm == "hierarchical" else "x"

    def body(*xs):
        return [
            (
                C.all_reduce(v, axis, "max", algorithm=algorithm),
                C.all_reduce(v, axis, "min", algorithm=algorithm),
                C.reduce(v, axis, 2, "max", algorithm=algorithm),
            )
            for v in xs
        ]

    spec = P(axis)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(FLOATS), out_specs=spec))
    xs = [_nan_input(d) for d in FLOATS]
    got = f(*[jax.device_put(x, NamedSharding(mesh, spec)) for x in xs])
    for x, (mx, mn, rd) in zip(xs, got, strict=True):
        want_max = np.maximum.reduce(x.astype(np.float32), axis=0)
        want_min = np.minimum.reduce(x.astype(np.float32), axis=0)
        for r in range(8):
            np.testing.assert_array_equal(np.asarray(mx, np.float32)[r], want_max)
            np.testing.assert_array_equal(np.asarray(mn, np.float32)[r], want_min)
        np.testing.assert_array_equal(np.asarray(rd, np.float32)[2], want_max)
        assert np.isnan(np.asarray(mx, np.float32)[:, [0, 2]]).all()


def test_dist_max_propagates_nan():
    x = dist.per_rank(lambda r: np.float32([np.nan if r == 3 else r, r]))
    got = np.stack(dist.to_ranks(dist.all_reduce(x, op="max")))
    assert np.isnan(got[:, 0]).all() and (got[:, 1] == 7).all()


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_float16_sums_accumulate_in_float32(n):
    mesh = mesh_1d(n)
    rng = np.random.default_rng(n)
    x = rng.uniform(900, 1100, (n, n * 3)).astype(np.float16)
    wide = x.astype(np.float32)

    def body(v):
        return (
            C.all_reduce(v, "x"),
            C.all_reduce(v, "x", "avg"),
            C.reduce(v, "x", n - 1),
            C.reduce_scatter(v, "x", tiled=True, scatter_dimension=1),
            C.all_reduce(v, "x", algorithm="ring"),
        )

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    s, a, r, rs, ring = (np.asarray(y) for y in f(jax.device_put(x, NamedSharding(mesh, P("x")))))
    total = wide.sum(0).astype(np.float16)
    for got in (s, ring):
        np.testing.assert_array_equal(got, np.tile(total, (n, 1)))
    np.testing.assert_array_equal(a, np.tile((wide.sum(0) / n).astype(np.float16), (n, 1)))
    np.testing.assert_array_equal(r[n - 1], total)
    np.testing.assert_array_equal(rs.reshape(n, -1), total.reshape(n, -1))
