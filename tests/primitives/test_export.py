"""Lowering contracts for GPU, checked without a GPU: ``jax.export`` for cuda and cpu.

Each program is exported for ``("cuda",)``, ``("cpu",)`` and both at once on this CPU-only
machine, and the collectives in the exported StableHLO are counted: what a GPU would run is
what the docstrings promise (NCCL broadcast on cuda, a ppermute tree on cpu and in a module for
both; one all-reduce for SUM/AVG/MIN/MAX; one collective-permute for sendrecv/shift).

What is exported for the CPU is also run: one program using every primitive, exported for
``("cpu",)`` and for ``("cuda", "cpu")``, called on the 8 simulated CPU devices and compared
with the NumPy oracle (XLA:CPU compiles every platform's code in a module, so a GPU-only op
anywhere in it fails the call).
"""

from __future__ import annotations

import inspect
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from tests.helpers import mesh_1d
from tests.primitives import oracle

N = 8
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "collective_broadcast",
)
PLATFORMS = {"cuda": ("cuda",), "cpu": ("cpu",), "both": ("cuda", "cpu")}
# XLA's ragged all-to-all is a custom call JAX gives no compatibility guarantee: exporting a
# module that holds it (lowered for GPUs only) needs this.
RAGGED_OK = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]


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
    # A module for cuda and cpu at once takes the tree on both (XLA:CPU has no broadcast).
    "broadcast": (
        lambda x: C.broadcast(x, "x", src=3),
        P(),
        {
            "cuda": {"collective_broadcast": 1},
            "cpu": {"collective_permute": TREE},
            "both": {"collective_permute": TREE},
        },
    ),
    "sum": (lambda x: C.all_reduce(x, "x"), P(), {"all": {"all_reduce": 1}}),
    "avg": (lambda x: C.all_reduce(x, "x", "avg"), P(), {"all": {"all_reduce": 1}}),
    "min": (lambda x: C.all_reduce(x, "x", "min"), P(), {"all": {"all_reduce": 1}}),
    "max": (lambda x: C.all_reduce(x, "x", "max"), P(), {"all": {"all_reduce": 1}}),
    # jax lowers all_gather per platform: an export for both carries one in each branch.
    "all_gather": (
        lambda x: C.all_gather(x, "x", tiled=True),
        P(),
        {"cuda": {"all_gather": 1}, "cpu": {"all_gather": 1}, "both": {"all_gather": 2}},
    ),
    "reduce_scatter": (
        lambda x: C.reduce_scatter(x, "x", tiled=True),
        P("x"),
        {"all": {"reduce_scatter": 1}},
    ),
    "sendrecv": (
        lambda x: C.sendrecv(x, "x", [(0, 5), (5, 0)]),
        P("x"),
        {"all": {"collective_permute": 1}},
    ),
    "shift": (lambda x: C.shift(x, "x", 2), P("x"), {"all": {"collective_permute": 1}}),
}


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("name", list(CASES))
def test_exported_collectives(name, platform):
    body, out_spec, expected = CASES[name]
    want = expected.get(platform, expected.get("all"))
    assert exported_counts(body, PLATFORMS[platform], out_spec) == want


def test_multi_platform_export_of_a_whole_program():
    """One program using every op exports for cuda and cpu together; the NCCL broadcast is in
    the module for cuda alone, and a module for both has the tree only."""

    def body(x):
        return (
            C.broadcast(x, "x", 1)
            + C.all_reduce(x, "x", "product")
            + C.reduce(x, "x", 2)
            + C.gather(x, "x", 0)[0]
            + C.scatter(x, "x", 1, tiled=True).repeat(N, axis=0)
            + C.all_to_all(x, "x", 0, 0, tiled=True)
        )

    cuda = exported_counts(body, ("cuda",), P("x"))
    both = exported_counts(body, ("cuda", "cpu"), P("x"))
    assert cuda["collective_broadcast"] == 1 and "collective_permute" not in cuda
    assert "collective_broadcast" not in both and both["collective_permute"] == TREE


def test_ragged_all_to_all_is_native_only_in_a_module_for_gpus_alone():
    mesh = mesh_1d(N)
    f = jax.jit(
        jax.shard_map(
            lambda x, s: C.ragged_all_to_all(x, "x", s[0])[0],
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )
    spec = NamedSharding(mesh, P("x"))
    args = (
        jax.ShapeDtypeStruct((N * 16, 4), jnp.float32, sharding=spec),
        jax.ShapeDtypeStruct((N, N), jnp.int32, sharding=spec),
    )

    def native(platforms):
        exported = jax.export.export(f, platforms=platforms, disabled_checks=RAGGED_OK)(*args)
        return exported.mlir_module().count("custom_call @ragged_all_to_all")

    assert native(("cuda",)) == 1
    assert native(("cuda", "cpu")) == 0
    assert native(("cpu",)) == 0


# --------------------------------------------------------------- exported, then called
M = 16  # rows per rank
OPS = ("sum", "avg", "product", "min", "max")
SEND = np.random.default_rng(1).integers(-1, 5, (N, N)).astype(np.int32)  # SEND[j, r]: j -> r
SIZE = np.array([0, 16, 3, 7, 16, 1, 9, 12], np.int32)  # rows of each rank's uneven gather
PARTS = {"even": [1, 2, 3, 2, 4, 0, 3, 1], "skewed": [9, 1, 1, 1, 1, 1, 1, 1]}  # sum to M


def every_primitive(x, send, size):
    """Rank r's result of every primitive on its ``x`` (M, 4) float32."""
    xi = jnp.round(x * 4).astype(jnp.int32)
    send, size = send[0], size[0]
    out = {
        "broadcast": C.broadcast(x, "x", 3, algorithm="native"),
        "broadcast_int": C.broadcast(xi, "x", 6, algorithm="native"),
        "reduce": C.reduce(x, "x", 2),
        "all_gather": C.all_gather(x, "x", tiled=True, algorithm="native"),
        "gather": C.gather(x, "x", 0),
        "scatter": C.scatter(x, "x", 1, tiled=True),
        "reduce_scatter": C.reduce_scatter(x, "x", tiled=True, algorithm="native"),
        "all_to_all": C.all_to_all(x, "x", 0, 0, tiled=True),
        "sendrecv": C.sendrecv(x, "x", [(0, 5), (5, 0)]),
        "shift": C.shift(x, "x", 2),
        "scan": C.scan(x, "x", "sum"),
        "exscan": C.exscan(xi, "x", "max"),
        "bxor": C.all_reduce(xi, "x", "bxor"),
        "ragged": C.ragged_all_to_all(x, "x", send, out_size=M),
        "all_gather_uneven": C.all_gather_uneven(x, "x", size),
        "gather_uneven": C.gather_uneven(x, "x", size, dst=1),
        "reduce_scatter_uneven": C.reduce_scatter_uneven(x, "x", PARTS["even"]),
        "reduce_scatter_uneven_max": C.reduce_scatter_uneven(x, "x", PARTS["skewed"], "max"),
        "rank": C.rank("x"),
        "world_size": jnp.int32(C.world_size("x")),
    }
    out |= {f"all_reduce[{op}]": C.all_reduce(x, "x", op, algorithm="native") for op in OPS}
    return jax.tree.map(lambda y: y[None], out)  # one row per rank


def expected(xs: list[np.ndarray]) -> dict:
    """The oracle's result of :func:`every_primitive`, each rank's stacked along axis 0."""
    xis = [np.round(x * 4).astype(np.int32) for x in xs]
    out = {
        "broadcast": oracle.broadcast(xs, 3),
        "broadcast_int": oracle.broadcast(xis, 6),
        "reduce": oracle.reduce(xs, "sum", 2),
        "all_gather": oracle.all_gather(xs, tiled=True),
        "gather": oracle.gather(xs, 0),
        "scatter": oracle.scatter(xs, 1, tiled=True),
        "reduce_scatter": oracle.reduce_scatter(xs, "sum", tiled=True),
        "all_to_all": oracle.all_to_all_tiled(xs),
        "sendrecv": oracle.sendrecv(xs, [(0, 5), (5, 0)]),
        "shift": oracle.shift(xs, 2),
        "scan": oracle.scan(xs, "sum"),
        "exscan": oracle.exscan(xis, "max"),
        "bxor": oracle.all_reduce(xis, "bxor"),
        "ragged": oracle.ragged_all_to_all(xs, SEND, M),
        "all_gather_uneven": oracle.all_gather_uneven(xs, SIZE),
        "gather_uneven": oracle.gather_uneven(xs, SIZE, 1),
        "reduce_scatter_uneven": oracle.reduce_scatter_uneven(xs, "sum", PARTS["even"]),
        "reduce_scatter_uneven_max": oracle.reduce_scatter_uneven(xs, "max", PARTS["skewed"]),
        "rank": list(range(N)),
        "world_size": [N] * N,
    }
    out |= {f"all_reduce[{op}]": oracle.all_reduce(xs, op) for op in OPS}
    return {k: jax.tree.map(lambda *ys: np.stack(ys), *v) for k, v in out.items()}


def test_the_program_uses_every_primitive():
    source = inspect.getsource(every_primitive)
    assert [name for name in C.__all__ if f"C.{name}(" not in source] == []


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    xs = [rng.uniform(0.5, 1.5, (M, 4)).astype(np.float32) for _ in range(N)]
    xs[4][2, 1] = -3.25  # a negative value for min/max and the integer ops
    return xs


@pytest.mark.parametrize("platforms", [("cpu",), ("cuda", "cpu")], ids=["cpu", "cuda+cpu"])
def test_exported_program_runs_on_cpu(platforms, inputs):
    """Export every primitive for ``platforms``, then call the export on 8 CPU devices."""
    mesh = mesh_1d(N)
    f = jax.jit(jax.shard_map(every_primitive, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    spec = NamedSharding(mesh, P("x"))
    args = (np.concatenate(inputs), SEND, SIZE)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=spec) for a in args]
    exported = jax.export.export(f, platforms=platforms, disabled_checks=RAGGED_OK)(*structs)
    assert exported.platforms == platforms
    got = exported.call(*(jax.device_put(a, spec) for a in args))

    want = expected(inputs)
    assert set(got) == set(want)
    for name, w in want.items():
        for g, e in zip(jax.tree.leaves(got[name]), jax.tree.leaves(w), strict=True):
            g = np.asarray(g)
            assert g.shape == e.shape, name
            if np.issubdtype(g.dtype, np.floating):
                np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=name)
            else:
                np.testing.assert_array_equal(g, e, err_msg=name)
