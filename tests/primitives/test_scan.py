"""scan and exscan against the NumPy oracle: every op each dtype allows, group sizes 1, 2, 3, 4,
8 and a 2-D mesh, jitted and eager, under pmap and vmap, gradients, lowering, errors.

XLA:CPU compiles each collective-permute in tens of milliseconds, so the full op x dtype
matrix (every combine and every identity) runs on n = 2 (one step, plus exscan's shift); the
other sizes (n = 3 takes a partial last step, n = 4 two steps, n = 8 three) run ops of each
kind of combine (sum, avg, product, min, max, bitwise, bool, complex).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from tests.helpers import bind, mesh_1d, run_per_rank
from tests.primitives import oracle
from tests.primitives.test_collectives import ALLOWED, DTYPES, RTOL, _config, make_inputs

FULL = {d: ALLOWED[oracle.kind_of(DTYPES[d])] for d in DTYPES}
SOME = {
    "float32": ["sum", "avg", "product", "max"],
    "int32": ["min", "band", "bxor"],
    "bool": ["sum", "min"],
    "complex64": ["sum"],
}
MATRIX = {"n1": SOME, "n2": FULL, "n3": SOME, "n4": SOME, "n8": SOME, "2d-both": SOME}
KINDS = ("scan", "exscan")


@functools.cache
def _run(label: str, jit: bool):
    mesh, axis_name, groups = _config(label)
    n, n_dev = len(groups[0]), mesh.devices.size
    table = MATRIX[label] if jit else {"float32": ["sum", "max"], "int32": ["bxor"]}
    inputs = {d: make_inputs(d, n_dev, n) for d in table}

    def body(*xs):
        return {
            d: {f"{k}[{op}]": getattr(C, k)(x, axis_name, op) for op in table[d] for k in KINDS}
            for d, x in zip(table, xs)
        }

    return table, inputs, run_per_rank(body, mesh, [inputs[d] for d in table], jit=jit)


MODES = [(label, True) for label in MATRIX] + [("n4", False)]


@pytest.mark.parametrize(
    "label, jit", MODES, ids=[f"{c}-{'jit' if j else 'eager'}" for c, j in MODES]
)
def test_matches_numpy_oracle(label, jit):
    _, _, groups = _config(label)
    table, inputs, got = _run(label, jit)
    failures = []
    for dname, ops in table.items():
        exact = oracle.kind_of(DTYPES[dname]) in ("bool", "integer")
        for op in ops:
            for k in KINDS:
                for members in groups:
                    want = getattr(oracle, k)([inputs[dname][d] for d in members], op)
                    for r, dev in enumerate(members):
                        g, e = got[dname][f"{k}[{op}]"][dev], np.asarray(want[r])
                        try:
                            assert g.dtype == inputs[dname].dtype and g.shape == e.shape
                            if exact or op in ("min", "max"):
                                np.testing.assert_array_equal(g, e.astype(g.dtype))
                            else:
                                tol = RTOL[dname]
                                np.testing.assert_allclose(oracle.widen(g), e, rtol=tol, atol=tol)
                        except AssertionError as err:
                            failures.append(f"{k}[{op}] {dname} rank {r}: {err}")
    assert not failures, "\n".join(failures[:5])


def test_exscan_rank0_is_the_identity_of_every_op():
    table, inputs, got = _run("n2", True)
    seen = set()
    for dname, ops in table.items():
        for op in ops:
            first = got[dname][f"exscan[{op}]"][0]
            np.testing.assert_array_equal(
                first, np.full_like(first, oracle.identity(op, first.dtype))
            )
            seen.add(op)
    assert seen == {"sum", "avg", "product", "min", "max", "band", "bor", "bxor"}
    assert got["int32"]["exscan[band]"][0].flat[0] == -1
    assert got["uint8"]["exscan[band]"][0].flat[0] == 255
    assert got["float32"]["exscan[min]"][0].flat[0] == np.inf


def test_nan_propagates_and_float16_sums_in_float32():
    mesh = mesh_1d(5)
    x = np.array([[1.0], [np.nan], [2.0], [3.0], [4.0]], np.float32)
    h = np.full((5, 1), 1000.0, np.float16) + np.arange(5, dtype=np.float16)[:, None]

    def body(x, h):
        return {"max": C.scan(x, "x", "max"), "min": C.exscan(x, "x", "min"), "h": C.scan(h, "x")}

    out = run_per_rank(body, mesh, [x, h], jit=True)
    np.testing.assert_array_equal(out["max"][:, 0], [1, np.nan, np.nan, np.nan, np.nan])
    np.testing.assert_array_equal(out["min"][:, 0], [np.inf, 1, np.nan, np.nan, np.nan])
    # float16 adds rank by rank would give 5008 (rounding at each step); float32 gives 5010.
    assert out["h"][4, 0] == np.float16(np.float32(h[:, 0].astype(np.float32).sum()))


# ---------------------------------------------------------------- pmap, vmap, gradients
N = 4


def _bind(binding: str, body):
    return bind(binding, body, N, "i")


def _cases(v):
    return {
        "scan": C.scan(v, "i"),
        "exscan": C.exscan(v, "i"),
        "avg": C.scan(v, "i", "avg"),
        "exmax": C.exscan(v, "i", "max"),
        "prod": C.scan(v, "i", "product"),
    }


LINEAR = {
    "scan": lambda X: jnp.cumsum(X, 0),
    "exscan": lambda X: jnp.cumsum(X, 0) - X,
    "avg": lambda X: jnp.cumsum(X, 0) / jnp.arange(1, N + 1).reshape(N, 1, 1),
}


def _x():
    rng = np.random.default_rng(0)
    return rng.uniform(0.5, 1.5, (N, 2, 3)).astype(np.float32)


@pytest.mark.parametrize("binding", ["shard_map", "shard_map_jit", "pmap", "vmap", "vmap_jit"])
def test_values_and_grad_under_every_binding(binding):
    """Plain and jitted shard_map, pmap, vmap: values against the oracle; and (jitted and
    pmap) the gradient of SUM/AVG scans (reversed suffix sums) against cumsum references,
    computed in the same program."""
    x = _x()
    f = _bind(binding, _cases)
    w = {
        k: np.random.default_rng(1 + i).normal(size=x.shape).astype(np.float32)
        for i, k in enumerate(LINEAR)
    }

    def both(X):
        def loss(X):
            out = f(X)
            return sum(jnp.sum(w[k] * out[k]) for k in LINEAR), out

        return jax.grad(loss, has_aux=True)(X)

    eager = binding in ("shard_map", "vmap")  # op by op: values only, the grad is jitted
    if eager:
        grad, got = None, f(x)
    else:
        grad, got = (jax.jit(both) if binding.endswith("_jit") else both)(x)
    xs = list(x)
    want = {
        "scan": oracle.scan(xs, "sum"),
        "exscan": oracle.exscan(xs, "sum"),
        "avg": oracle.scan(xs, "avg"),
        "exmax": oracle.exscan(xs, "max"),
        "prod": oracle.scan(xs, "product"),
    }
    for name, rows in want.items():
        np.testing.assert_allclose(
            np.asarray(got[name]), np.stack(rows), rtol=1e-6, err_msg=f"{name} under {binding}"
        )
    if eager:
        return
    expected = jax.grad(lambda X: sum(jnp.sum(w[k] * ref(X)) for k, ref in LINEAR.items()))(x)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ lowering
@pytest.mark.parametrize("n", [2, 3, 8])
def test_log_n_collective_permutes(n):
    mesh = mesh_1d(n)
    f = jax.jit(
        jax.shard_map(
            lambda v: (C.scan(v, "x"), C.exscan(v, "x", "max")),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )
    x = jax.device_put(jnp.zeros((n * 4, 2)), NamedSharding(mesh, P("x")))
    text = f.lower(x).as_text()
    steps = math.ceil(math.log2(n))
    assert text.count("stablehlo.collective_permute") == steps + (steps + 1)
    assert "all_gather" not in text and "all_reduce" not in text


# -------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "body, error, match",
    [
        (lambda x: C.scan(x, "x", "median"), ValueError, r"scan: op='median' is not a reduce op"),
        (
            lambda x: C.exscan(x, "x", "bxor"),
            TypeError,
            r"exscan: op=ReduceOp.BXOR is not defined for dtype float32",
        ),
        (
            lambda x: C.scan(x.astype(jnp.int32), "x", "avg"),
            TypeError,
            r"scan: op=ReduceOp.AVG is not defined for dtype int32",
        ),
        (
            lambda x: C.scan(x.astype(jnp.complex64), "x", "max").real,
            TypeError,
            r"scan: op=ReduceOp.MAX is not defined for dtype complex64",
        ),
        (lambda x: C.exscan(x, "y"), ValueError, r"exscan: axis_name='y' is not bound here"),
        (lambda x: C.scan({"a": "text"}, "x"), TypeError, r"scan: x must be an array or a number"),
    ],
)
def test_errors(body, error, match):
    mesh = mesh_1d(4)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(error, match=match):
        f.trace(jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=NamedSharding(mesh, P("x"))))
