"""dp.sync.packing: the sharded strategies' all-gathers and reduce-scatters by buckets.

Every leaf's result against a NumPy oracle built from each rank's input, and bit for bit
against the per-leaf primitive, for buckets of one leaf (``bucket_bytes=None``), of several
leaves, and of every leaf of a dtype; float32, bfloat16 and int32 leaves split along their
first, middle and last dimension; over the 8 devices (native), over a (node, local) tuple
axis (hierarchical, built on ppermute) and over one axis of a 2-D mesh (the results keep
varying over the other). Every case of a mesh compiles into one program. The lowered program
holds one collective per bucket; the varying types (``check_vma``) are the per-leaf
primitives'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from jaxcoll import dp
from jaxcoll._core.vma import axis_names, cast_varying, varying_axes
from jaxcoll.dp.sync.packing import gather_leaves, scatter_leaves
from tests.dp.test_export import _executed, _functions
from tests.helpers import mesh_1d, mesh_2d

# (whole shape with 8 | the split dimension, split dimension, dtype)
LEAVES = [
    ((16, 3), 0, np.float32),
    ((3, 8), 1, np.float32),
    ((2, 3, 16), 2, np.float32),
    ((8,), 0, np.float32),
    ((5, 24, 2), 1, np.float32),
    ((8, 4), 0, jnp.bfloat16),
    ((16, 2), 0, jnp.bfloat16),
    ((4, 16), 1, np.int32),
    ((24, 5), 0, np.float32),
]
# 600 bytes: several buckets, some of several leaves (plan_buckets on the whole leaves)
BUCKETS = {"per-leaf": None, "small": 600.0, "one-per-dtype": 1e9}
CASES = {  # mesh, the axis gathered/scattered over, algorithm, bucket sizes
    "8-native": (lambda: mesh_1d(8, "x"), "x", "native", tuple(BUCKETS)),
    "2x4-hierarchical": (lambda: mesh_2d(2, 4), ("node", "local"), "hierarchical", ("small",)),
    "local-of-2x4": (lambda: mesh_2d(2, 4), "local", "auto", ("small",)),
}


def _rank_inputs(rng, n_dev):
    """Per device, random values of every leaf's whole shape, twice: its shard source (cut to
    the slice's shape in :func:`_run`) and its whole local gradient."""
    shards, grads = [], []

    def draw(shape, dtype):
        if dtype == np.int32:
            return rng.integers(-50, 50, size=(n_dev, *shape)).astype(dtype)
        return np.asarray(rng.normal(size=(n_dev, *shape)), dtype)

    for shape, _, dtype in LEAVES:
        grads.append(draw(shape, dtype))
        shards.append(draw(shape, dtype))  # cut per group below
    return shards, grads


def _rows(mesh, axis):
    """For each device (row-major over the mesh): the devices of its group along ``axis`` in
    rank order, and its own rank in that group."""
    names = mesh.axis_names
    coords = np.array(np.unravel_index(np.arange(mesh.size), mesh.devices.shape)).T
    over = [names.index(a) for a in axis_names(axis)]
    groups, ranks = [], []
    for c in coords:
        members = [
            k
            for k, o in enumerate(coords)
            if all(o[j] == c[j] for j in range(len(names)) if j not in over)
        ]
        groups.append(members)  # row-major order of the mesh = rank order over ``over``
        ranks.append(members.index(int(np.ravel_multi_index(c, mesh.devices.shape))))
    return groups, ranks


def _run(mesh, axis, algorithm, buckets):
    rng = np.random.default_rng(0)
    n_dev = mesh.size
    n = int(np.prod([mesh.shape[a] for a in axis_names(axis)]))
    shards_full, grads = _rank_inputs(rng, n_dev)
    # each device's shard: its slice of a random whole leaf per group (any values would do)
    shards = [
        np.take(s, np.arange(s.shape[1 + d] // n), axis=1 + d)
        for s, (_, d, _) in zip(shards_full, LEAVES, strict=True)
    ]
    dims = [d for _, d, _ in LEAVES]
    floats = [i for i, (_, _, t) in enumerate(LEAVES) if t != np.int32]
    all_axes = tuple(mesh.axis_names)
    types = {}

    def body(shards, grads):
        shards, grads = [x[0] for x in shards], [g[0] for g in grads]
        out = {}
        for name in buckets:
            bb = BUCKETS[name]
            out[f"gather/{name}"] = gather_leaves(
                shards, dims, axis, algorithm=algorithm, bucket_bytes=bb
            )
            out[f"scatter/{name}"] = scatter_leaves(
                grads, dims, axis, algorithm=algorithm, bucket_bytes=bb
            )
            out[f"wire/{name}"] = scatter_leaves(
                [grads[i] for i in floats],
                [dims[i] for i in floats],
                axis,
                algorithm=algorithm,
                bucket_bytes=bb,
                wire_dtype=jnp.bfloat16,
            )
        out["gather/ref"] = [
            C.all_gather(x, axis, dim=d, tiled=True, algorithm=algorithm)
            for x, d in zip(shards, dims, strict=True)
        ]
        out["scatter/ref"] = [
            C.reduce_scatter(g, axis, "sum", scatter_dimension=d, tiled=True, algorithm=algorithm)
            for g, d in zip(grads, dims, strict=True)
        ]
        out["wire/ref"] = [
            C.reduce_scatter(
                grads[i].astype(jnp.bfloat16),
                axis,
                "sum",
                scatter_dimension=dims[i],
                tiled=True,
                algorithm=algorithm,
            ).astype(grads[i].dtype)
            for i in floats
        ]
        for k, v in out.items():
            types[k] = [varying_axes(x) for x in v]
        # every result as this device's row (the gathered ones are the same per group)
        return {k: [cast_varying(x, all_axes)[None] for x in v] for k, v in out.items()}

    spec = P(all_axes)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    args = ([put(s) for s in shards], [put(g) for g in grads])
    out = f(*args)
    got = {k: [np.asarray(x) for x in v] for k, v in out.items()}
    return got, types, shards, grads, floats, n, f.lower(*args).as_text()


@pytest.mark.parametrize("case", list(CASES))
def test_bucketed_collectives_equal_the_oracle_and_the_per_leaf_primitives(case):
    make_mesh, axis, algorithm, buckets = CASES[case]
    mesh = make_mesh()
    got, types, shards, grads, floats, n, text = _run(mesh, axis, algorithm, buckets)
    groups, ranks = _rows(mesh, axis)
    dims = [d for _, d, _ in LEAVES]
    others = set(mesh.axis_names) - set(axis_names(axis))
    for name in buckets:
        for i, d in enumerate(dims):
            for dev in range(mesh.size):
                members = groups[dev]
                whole = np.concatenate([shards[i][m] for m in members], axis=d)
                np.testing.assert_array_equal(got[f"gather/{name}"][i][dev], whole)
                total = np.sum([grads[i][m].astype(np.float64) for m in members], axis=0)
                part = np.split(total, n, axis=d)[ranks[dev]]
                tol = 2e-2 if LEAVES[i][2] == jnp.bfloat16 else 1e-5
                np.testing.assert_allclose(
                    got[f"scatter/{name}"][i][dev].astype(np.float64), part, rtol=tol, atol=tol
                )
        for kind in ("gather", "scatter", "wire"):  # bit for bit the per-leaf results
            for a, b in zip(got[f"{kind}/{name}"], got[f"{kind}/ref"], strict=True):
                np.testing.assert_array_equal(a, b)
            # the per-leaf primitives' types: gathered invariant over the axis (varying over
            # the others), scattered varying
            assert types[f"{kind}/{name}"] == types[f"{kind}/ref"], (kind, name)
        assert all(t == others for t in types[f"gather/{name}"])
        assert all(t == set(mesh.axis_names) for t in types[f"scatter/{name}"])
        for a, j in zip(got[f"wire/{name}"], floats, strict=True):  # in the gradient's dtype
            assert a.dtype == grads[j].dtype
    if case == "8-native":  # one collective per bucket, per kind and dtype
        wholes = [jax.ShapeDtypeStruct(s, t) for s, _, t in LEAVES]
        wire = [jax.ShapeDtypeStruct(LEAVES[i][0], jnp.bfloat16) for i in floats]
        count = lambda bb, leaves: len(dp.plan_buckets(leaves, bb))  # noqa: E731
        counts = {bb: (count(bb, wholes), count(bb, wire)) for bb in BUCKETS.values()}
        assert counts[None] == (len(LEAVES), len(floats))
        # a bucket per run of one dtype (last leaves first: f32, i32, bf16, f32) | all bf16
        assert counts[1e9] == (4, 1)
        assert len(LEAVES) > counts[600.0][0] > 3
        gathers = sum(c[0] for c in counts.values()) + len(LEAVES)  # + the reference
        scatters = sum(c[0] + c[1] for c in counts.values()) + len(LEAVES) + len(floats)
        funcs = _functions(text)
        assert _executed(funcs, "main", "stablehlo.all_gather") == gathers
        assert _executed(funcs, "main", "stablehlo.reduce_scatter") == scatters


def test_bad_dims_are_named():
    mesh = mesh_1d(8, "x")

    def call(fn, leaves, dims):
        body = lambda *xs: fn(list(xs), dims, "x", bucket_bytes=None)  # noqa: E731
        spec = (P("x"),) * len(leaves)
        jax.eval_shape(
            jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec),
            *[jax.ShapeDtypeStruct(s, np.float32) for s in leaves],
        )

    with pytest.raises(ValueError, match=r"gather_leaves: got 2 shards and 1 dims; pass one"):
        call(gather_leaves, [(8, 2), (8,)], [0])
    with pytest.raises(ValueError, match=r"scatter_leaves: dims=2 is out of range for a leaf"):
        call(scatter_leaves, [(64, 2)], [2])
    with pytest.raises(TypeError, match=r"gather_leaves: dims must hold ints, got 0\.0"):
        call(gather_leaves, [(8, 2)], [0.0])
    with pytest.raises(
        ValueError,
        match=r"scatter_leaves: a gradient of shape \(1, 2\) cannot be split along "
        r"dims=1 over 8 ranks \(2 is not a multiple of 8\)",
    ):
        call(scatter_leaves, [(8, 2)], [1])
