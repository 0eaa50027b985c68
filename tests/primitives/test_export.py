"""Lowering contracts for GPU, checked without a GPU: ``jax.export`` for cuda and cpu.

Each program is exported for ``("cuda",)``, ``("cpu",)`` and both at once on this CPU-only
machine, and the collectives in the exported StableHLO are counted: what a GPU would run is
what the docstrings promise (NCCL broadcast on cuda, a ppermute tree on cpu; one all-reduce
for SUM/AVG/MIN/MAX; one collective-permute for sendrecv/shift).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from tests.helpers import mesh_1d

N = 8
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute",
               "collective_broadcast")
PLATFORMS = {"cuda": ("cuda",), "cpu": ("cpu",), "both": ("cuda", "cpu")}


def exported_counts(body, platforms, out_spec) -> dict[str, int]:
    mesh = mesh_1d(N)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_spec))
    arg = jax.ShapeDtypeStruct((N * 16, 4), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    text = jax.export.export(f, platforms=platforms)(arg).mlir_module()
    counts = {c: len(re.findall(rf'stablehlo\.{c}"?[\s(]', text)) for c in COLLECTIVES}
    return {c: k for c, k in counts.items() if k}


TREE = math.ceil(math.log2(N))
CASES = {
    # name: (body, out_spec, {platform: expected counts})
    "broadcast": (lambda x: C.broadcast(x, "x", src=3), P(),
                  {"cuda": {"collective_broadcast": 1}, "cpu": {"collective_permute": TREE},
                   "both": {"collective_broadcast": 1, "collective_permute": TREE}}),
    "sum": (lambda x: C.all_reduce(x, "x"), P(), {"all": {"all_reduce": 1}}),
    "avg": (lambda x: C.all_reduce(x, "x", "avg"), P(), {"all": {"all_reduce": 1}}),
    "min": (lambda x: C.all_reduce(x, "x", "min"), P(), {"all": {"all_reduce": 1}}),
    "max": (lambda x: C.all_reduce(x, "x", "max"), P(), {"all": {"all_reduce": 1}}),
    # jax lowers all_gather per platform: an export for both carries one in each branch.
    "all_gather": (lambda x: C.all_gather(x, "x", tiled=True), P(),
                   {"cuda": {"all_gather": 1}, "cpu": {"all_gather": 1},
                    "both": {"all_gather": 2}}),
    "reduce_scatter": (lambda x: C.reduce_scatter(x, "x", tiled=True), P("x"),
                       {"all": {"reduce_scatter": 1}}),
    "sendrecv": (lambda x: C.sendrecv(x, "x", [(0, 5), (5, 0)]), P("x"),
                 {"all": {"collective_permute": 1}}),
    "shift": (lambda x: C.shift(x, "x", 2), P("x"), {"all": {"collective_permute": 1}}),
}


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("name", list(CASES))
def test_exported_collectives(name, platform):
    body, out_spec, expected = CASES[name]
    want = expected.get(platform, expected.get("all"))
    assert exported_counts(body, PLATFORMS[platform], out_spec) == want


def test_multi_platform_export_of_a_whole_program():
    """One program using every op exports for cuda and cpu together."""
    def body(x):
        return (C.broadcast(x, "x", 1) + C.all_reduce(x, "x", "product")
                + C.reduce(x, "x", 2) + C.gather(x, "x", 0)[0] + C.scatter(x, "x", 1, tiled=True)
                .repeat(N, axis=0) + C.all_to_all(x, "x", 0, 0, tiled=True))
    counts = exported_counts(body, ("cuda", "cpu"), P("x"))
    assert counts["collective_broadcast"] == 1
    assert counts["collective_permute"] == TREE
