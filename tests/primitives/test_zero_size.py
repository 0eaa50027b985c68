"""Zero-size leaves: every op gives the correct empty result (no collective can fail on it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from tests.helpers import mesh_1d

N = 8


def _ops(alg):
    i32 = jnp.int32
    return {
        "sum": (lambda v: C.all_reduce(v, "x", algorithm=alg), (N, 0)),
        "avg": (lambda v: C.all_reduce(v, "x", "avg", algorithm=alg), (N, 0)),
        "product": (lambda v: C.all_reduce(v, "x", "product", algorithm=alg), (N, 0)),
        "max": (lambda v: C.all_reduce(v, "x", "max", algorithm=alg), (N, 0)),
        "band": (lambda v: C.all_reduce(v.astype(i32), "x", "band", algorithm=alg), (N, 0)),
        "bor": (lambda v: C.all_reduce(v.astype(i32), "x", "bor", algorithm=alg), (N, 0)),
        "bxor": (lambda v: C.all_reduce(v.astype(i32), "x", "bxor", algorithm=alg), (N, 0)),
        "reduce": (lambda v: C.reduce(v, "x", 1, "product", algorithm=alg), (N, 0)),
        "broadcast": (lambda v: C.broadcast(v, "x", 1, algorithm=alg), (N, 0)),
        "all_gather": (lambda v: C.all_gather(v, "x", algorithm=alg), (N, N, 0)),
        "all_gather_tiled": (lambda v: C.all_gather(v, "x", tiled=True, algorithm=alg), (N * N, 0)),
        "reduce_scatter": (lambda v: C.reduce_scatter(v, "x", algorithm=alg), (0,)),
        "reduce_scatter_max_tiled": (
            lambda v: C.reduce_scatter(
                v, "x", "max", tiled=True, scatter_dimension=1, algorithm=alg
            ),
            (N, 0),
        ),
        "gather": (lambda v: C.gather(v, "x", 0), (N, N, 0)),
        "scatter": (lambda v: C.scatter(v, "x", 0), (0,)),
        "all_to_all": (lambda v: C.all_to_all(v, "x", 0, 1), (0, N)),
        "sendrecv": (lambda v: C.sendrecv(v, "x", [(0, 1)]), (N, 0)),
        "shift": (lambda v: C.shift(v, "x"), (N, 0)),
    }


@pytest.mark.parametrize("alg", ["native", "ring", "tree", "auto"])
def test_zero_size_leaves(alg):
    mesh = mesh_1d(N)
    ops = _ops(alg)
    f = jax.jit(
        jax.shard_map(
            lambda v: {k: op(v[0])[None] for k, (op, _) in ops.items()},
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )
    got = f(jax.device_put(np.zeros((N, N, 0), np.float32), NamedSharding(mesh, P("x"))))
    for k, (_, shape) in ops.items():
        assert got[k].shape == (N,) + shape, k
        assert got[k].size == 0
