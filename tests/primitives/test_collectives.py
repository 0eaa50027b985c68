"""Every primitive x every reduce op it allows x dtypes x group sizes 1, 2, 3, 4, 8 and a 2-D
mesh, eager and under jax.jit, against the NumPy oracle in ``oracle.py``.

To keep the suite fast, one shard_map program per (mesh, mode) computes every case for every
dtype at once; the tests below then check one dtype each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcoll.primitives as C
from tests.helpers import mesh_1d, mesh_2d, run_per_rank
from tests.primitives import oracle

DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "int32": jnp.int32,
    "uint8": jnp.uint8,
    "bool": jnp.bool_,
    "complex64": jnp.complex64,
}
# Which ops each kind of dtype allows (the rules, restated independently of jaxcoll).
ALLOWED = {
    "bool": ["sum", "product", "min", "max", "band", "bor", "bxor"],
    "integer": ["sum", "product", "min", "max", "band", "bor", "bxor"],
    "floating": ["sum", "avg", "product", "min", "max"],
    "complex": ["sum", "avg", "product"],
}
# Eager shard_map compiles every staged collective separately, per dtype; one dtype of each
# kind (float, integer, bool, complex) takes every code path. jit runs all seven.
EAGER_DTYPES = ("float32", "int32", "bool", "complex64")
RTOL = {"float32": 1e-5, "complex64": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}

# (label, axis_name, groups): groups lists, per group, the flat device indices in rank order.
CONFIGS = {
    "n1": ("x", [[0]]),
    "n2": ("x", [[0, 1]]),
    "n3": ("x", [[0, 1, 2]]),
    "n4": ("x", [[0, 1, 2, 3]]),
    "n8": ("x", [list(range(8))]),
    "2d-local": ("local", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "2d-node": ("node", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    "2d-both": (("node", "local"), [list(range(8))]),
    # jax.make_mesh (Explicit axis types) with a multi-letter axis name, as users write it.
    "explicit-n4": ("ranks", [[0, 1, 2, 3]]),
}


def make_inputs(dtype_name: str, n_devices: int, n: int) -> np.ndarray:
    """One (2n, 3) array per device, values chosen so products neither overflow nor vanish."""
    rng = np.random.default_rng(abs(hash((dtype_name, n_devices, n))) % 2**32)
    shape = (n_devices, 2 * n, 3)
    if dtype_name == "bool":
        return rng.random(shape) < 0.5
    if dtype_name in ("int32", "uint8"):
        lo = -4 if dtype_name == "int32" else 0
        return rng.integers(lo, 5, shape).astype(dtype_name)
    mag = rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)
    if dtype_name == "complex64":
        phase = rng.uniform(0, 2 * np.pi, shape)
        return (mag * np.exp(1j * phase)).astype(np.complex64)
    return np.asarray(jnp.asarray(mag, DTYPES[dtype_name]))


def cases(kind: str, n: int):
    """(name, body(x, axis_name), oracle(list_of_rank_inputs), exact) for one dtype kind."""
    out = []
    for op in ALLOWED[kind]:
        exact = kind in ("bool", "integer") or op in ("min", "max")
        out.append(
            (
                f"all_reduce[{op}]",
                lambda x, a, op=op: C.all_reduce(x, a, op),
                lambda xs, op=op: oracle.all_reduce(xs, op),
                exact,
            )
        )
        dst = n - 1
        out.append(
            (
                f"reduce[{op},dst={dst}]",
                lambda x, a, op=op, d=dst: C.reduce(x, a, d, op),
                lambda xs, op=op, d=dst: oracle.reduce(xs, op, d),
                exact,
            )
        )
        for tiled in (True, False):

            def rs(x, a, op=op, tiled=tiled):
                y = x if tiled else x.reshape((n, 2, 3))
                return C.reduce_scatter(y, a, op, tiled=tiled)

            def rs_oracle(xs, op=op, tiled=tiled):
                return oracle.reduce_scatter(
                    [x if tiled else x.reshape((n, 2, 3)) for x in xs], op, tiled
                )

            out.append((f"reduce_scatter[{op},tiled={tiled}]", rs, rs_oracle, exact))
    src = n // 2
    out += [
        (
            f"broadcast[src={src}]",
            lambda x, a: C.broadcast(x, a, src),
            lambda xs: oracle.broadcast(xs, src),
            True,
        ),
        (
            "all_gather",
            lambda x, a: C.all_gather(x, a),
            lambda xs: oracle.all_gather(xs, False),
            True,
        ),
        (
            "all_gather[tiled]",
            lambda x, a: C.all_gather(x, a, tiled=True),
            lambda xs: oracle.all_gather(xs, True),
            True,
        ),
        (
            f"gather[dst={src}]",
            lambda x, a: C.gather(x, a, src),
            lambda xs: oracle.gather(xs, src),
            True,
        ),
        (
            f"scatter[src={n - 1},tiled]",
            lambda x, a: C.scatter(x, a, n - 1, tiled=True),
            lambda xs: oracle.scatter(xs, n - 1, True),
            True,
        ),
        (
            "scatter[src=0]",
            lambda x, a: C.scatter(x.reshape((n, 2, 3)), a, 0),
            lambda xs: oracle.scatter([x.reshape((n, 2, 3)) for x in xs], 0, False),
            True,
        ),
        (
            "all_to_all[tiled]",
            lambda x, a: C.all_to_all(x, a, 0, 0, tiled=True),
            oracle.all_to_all_tiled,
            True,
        ),
        (
            "all_to_all[split=1,concat=0]",
            lambda x, a: C.all_to_all(x.reshape((2, n, 3)), a, 1, 0),
            lambda xs: oracle.all_to_all_untiled([x.reshape((2, n, 3)) for x in xs], 1, 0),
            True,
        ),
        ("shift[+1]", lambda x, a: C.shift(x, a, 1), lambda xs: oracle.shift(xs, 1), True),
        ("shift[-2]", lambda x, a: C.shift(x, a, -2), lambda xs: oracle.shift(xs, -2), True),
    ]
    pairs = [(0, 0)] if n == 1 else [(0, n - 1), (n - 1, 0)] + ([(1, 2)] if n >= 4 else [])
    out.append(
        (
            f"sendrecv{pairs}",
            lambda x, a: C.sendrecv(x, a, pairs),
            lambda xs: oracle.sendrecv(xs, pairs),
            True,
        )
    )
    return out


def _config(label):
    axis_name, groups = CONFIGS[label]
    if label.startswith("2d"):
        mesh = mesh_2d()
    elif label.startswith("explicit"):
        mesh = jax.make_mesh((len(groups[0]),), (axis_name,), devices=jax.devices()[:4])
    else:
        mesh = mesh_1d(len(groups[0]))
    return mesh, axis_name, groups


@functools.cache
def _run(label: str, jit: bool):
    """Run every case for every dtype in one program; return (inputs, outputs) per dtype."""
    mesh, axis_name, groups = _config(label)
    n, n_dev = len(groups[0]), mesh.devices.size
    dtypes = list(DTYPES) if jit else list(EAGER_DTYPES)
    inputs = {d: make_inputs(d, n_dev, n) for d in dtypes}

    def body(*xs):
        res = {}
        for dname, x in zip(dtypes, xs):
            kind = oracle.kind_of(DTYPES[dname])
            res[dname] = {name: fn(x, axis_name) for name, fn, _, _ in cases(kind, n)}
        return res

    outputs = run_per_rank(body, mesh, [inputs[d] for d in dtypes], jit=jit)
    return inputs, outputs


# Eager shard_map runs the same staged per-collective programs as jit (which runs on every
# group), so it runs on two: an odd size and a tuple axis over a 2-D mesh.
EAGER_CONFIGS = ("n3", "2d-both")
LABELS = [c for c in CONFIGS if not c.startswith("explicit")]
MODES = [(c, d, True) for c in LABELS for d in DTYPES] + [
    (c, d, False) for c in EAGER_CONFIGS for d in EAGER_DTYPES
]


@pytest.mark.parametrize(
    "label, dtype_name, jit", MODES, ids=[f"{c}-{d}-{'jit' if j else 'eager'}" for c, d, j in MODES]
)
def test_matches_numpy_oracle(label, dtype_name, jit):
    failures = _check(label, dtype_name, jit)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_matches_numpy_oracle_on_explicit_mesh(dtype_name):
    failures = _check("explicit-n4", dtype_name, True)
    assert not failures, "\n".join(failures[:10])


def _check(label, dtype_name, jit) -> list[str]:
    """Compare every case of one dtype with the oracle; return the mismatches."""
    _, _, groups = _config(label)
    inputs, outputs = _run(label, jit)
    kind = oracle.kind_of(DTYPES[dtype_name])
    n = len(groups[0])
    failures = []
    for name, _, ref, exact in cases(kind, n):
        got = outputs[dtype_name][name]
        for members in groups:
            expected = ref([inputs[dtype_name][d] for d in members])
            for r, dev in enumerate(members):
                g, e = got[dev], np.asarray(expected[r])
                try:
                    assert g.shape == e.shape, f"shape {g.shape} != {e.shape}"
                    if exact:
                        np.testing.assert_array_equal(g, e.astype(g.dtype))
                    else:
                        tol = RTOL[dtype_name]
                        np.testing.assert_allclose(oracle.widen(g), e, rtol=tol, atol=tol)
                except AssertionError as err:
                    failures.append(f"{name} rank {r} (device {dev}): {err}")
    return failures


def test_oracle_detects_a_wrong_answer():
    """The comparison above can fail: a result off by one element is reported."""
    inputs, outputs = _run("n4", True)
    xs = [inputs["int32"][d] for d in range(4)]
    wrong = oracle.all_reduce(xs, "sum")[0].copy()
    wrong[0, 0] += 1
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(outputs["int32"]["all_reduce[sum]"][0], wrong)
    np.testing.assert_array_equal(
        outputs["int32"]["all_reduce[sum]"][0], oracle.all_reduce(xs, "sum")[0]
    )


def test_pytree_inputs_keep_their_structure():
    mesh = mesh_1d(4)
    a = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    b = np.arange(4, dtype=np.int32).reshape(4, 1) * 10

    def body(a, b):
        tree = {"w": a, "layers": [b, (a * 2,)]}
        return {
            "sum": C.all_reduce(tree, "x"),
            "max": C.all_reduce(tree, "x", "max"),
            "bcast": C.broadcast(tree, "x", 3),
        }

    out = run_per_rank(body, mesh, [a, b], jit=True)
    assert jax.tree_util.tree_structure(out["sum"]) == jax.tree_util.tree_structure(
        {"w": 0, "layers": [0, (0,)]}
    )
    np.testing.assert_array_equal(out["sum"]["w"][2], a.sum(0))
    np.testing.assert_array_equal(out["sum"]["layers"][0][1], b.sum(0))
    np.testing.assert_array_equal(out["max"]["layers"][1][0][0], (a * 2).max(0))
    np.testing.assert_array_equal(out["bcast"]["layers"][0][0], b[3])


def test_bool_sum_is_logical_or_as_in_torch():
    mesh = mesh_1d(4)
    x = np.array([[False], [True], [False], [False]])
    out = run_per_rank(lambda v: C.all_reduce(v, "x"), mesh, [x], jit=True)
    assert out.dtype == np.bool_
    np.testing.assert_array_equal(out[:, 0], [True] * 4)


def test_rank_and_world_size_on_a_2d_mesh():
    mesh = mesh_2d()

    def body(x):
        return {
            "both": C.rank(("node", "local")) + 0 * x[0].astype(jnp.int32),
            "local": C.rank("local") + 0 * x[0].astype(jnp.int32),
            "sizes": jnp.array(
                [C.world_size("node"), C.world_size("local"), C.world_size(("node", "local"))]
            ),
        }

    out = run_per_rank(body, mesh, [np.zeros((8, 1))], jit=True)
    np.testing.assert_array_equal(out["both"], np.arange(8))
    np.testing.assert_array_equal(out["local"], np.arange(8) % 4)
    np.testing.assert_array_equal(out["sizes"][5], [2, 4, 8])
