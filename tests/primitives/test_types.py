"""Types follow values: a result that is the same on every rank is typed invariant.

Inside ``shard_map`` with checking on, all_reduce (every op and dtype kind), broadcast and
all_gather come back typed invariant for every algorithm, so ``out_specs=P()`` compiles
whichever ``algorithm=`` (or ``auto``'s table) is used. Results that differ per rank (reduce,
gather, reduce_scatter, scatter, sendrecv) stay varying. Checked at trace time (types) and by
running the program with ``out_specs=P()`` against the NumPy result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from jaxcoll._core.vma import varying_axes
from tests.helpers import mesh_1d, mesh_2d

ALGORITHMS = ["native", "ring", "tree", "auto", "hierarchical"]
OPS = {
    "float32": ["sum", "avg", "product", "min", "max"],
    "int32": ["sum", "product", "min", "max", "band", "bor", "bxor"],
    "bool": ["sum", "product", "min", "max", "bxor"],
}


def _mesh_axis(algorithm):
    if algorithm == "hierarchical":
        return mesh_2d(2, 4), ("node", "local")
    return mesh_1d(8), "x"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_replicated_results_are_invariant(algorithm):
    mesh, axis = _mesh_axis(algorithm)
    names = axis if isinstance(axis, tuple) else (axis,)
    seen = {}

    def body(f, i):
        b = i % 2 == 0
        x = {"float32": f, "int32": i, "bool": b}
        out = {
            f"{k}_{op}": C.all_reduce(x[k], axis, op, algorithm=algorithm)
            for k, ops in OPS.items()
            for op in ops
        }
        out["broadcast"] = C.broadcast(f, axis, src=5, algorithm=algorithm)
        out["broadcast_bool"] = C.broadcast(b, axis, src=2, algorithm=algorithm)
        out["all_gather"] = C.all_gather(f, axis, algorithm=algorithm)
        out["all_gather_tiled"] = C.all_gather(i, axis, tiled=True, algorithm=algorithm)
        for name, y in out.items():
            seen[name] = varying_axes(y)
        return out

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=P()))
    rng = np.random.default_rng(0)
    fx = rng.uniform(0.5, 1.5, (8, 3)).astype(np.float32)
    ix = rng.integers(1, 9, (8, 3)).astype(np.int32)
    sharding = NamedSharding(mesh, P(names))
    got = f(jax.device_put(fx, sharding), jax.device_put(ix, sharding))
    assert {k: set(v) for k, v in seen.items() if v} == {}
    np.testing.assert_allclose(got["float32_sum"], fx.sum(0, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(got["int32_bxor"], np.bitwise_xor.reduce(ix, 0)[None])
    np.testing.assert_array_equal(got["broadcast"], fx[5:6])
    np.testing.assert_array_equal(got["all_gather"], fx[:, None])
    np.testing.assert_array_equal(got["all_gather_tiled"], ix)


def test_per_rank_results_stay_varying():
    mesh = mesh_1d(8)
    seen = {}

    def body(x):
        out = {
            "reduce": C.reduce(x, "x", 0),
            "gather": C.gather(x, "x", 0),
            "reduce_scatter": C.reduce_scatter(x, "x", tiled=True),
            "scatter": C.scatter(x, "x", 0, tiled=True),
            "shift": C.shift(x, "x"),
        }
        seen.update({k: varying_axes(v) for k, v in out.items()})
        return out

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))).lower(
        jax.device_put(jnp.zeros((64,)), NamedSharding(mesh, P("x")))
    )
    assert all(v == {"x"} for v in seen.values()), seen
