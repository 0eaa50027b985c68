"""jax.grad through the linear collectives equals the gradient of the NumPy reference.

For an op f and random weights W, F(X) = sum(W * f(X)) over every rank's output. The oracle is a
finite difference of the NumPy reference in float64: f is linear, so F(X + e_i) - F(X) is exactly
dF/dX_i. jaxcoll's gradient is taken with jax.grad over the global (sharded) input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from tests.helpers import mesh_1d, mesh_2d
from tests.primitives import oracle

ROWS = 2  # each rank holds (ROWS * n, 3)


def _ops(n):
    pairs = [(0, n - 1), (n - 1, 0)] if n > 1 else [(0, 0)]
    return {
        "all_reduce[sum]": (
            lambda x, a: C.all_reduce(x, a),
            lambda xs: oracle.all_reduce(xs, "sum"),
        ),
        "all_reduce[avg]": (
            lambda x, a: C.all_reduce(x, a, "avg"),
            lambda xs: oracle.all_reduce(xs, "avg"),
        ),
        "reduce[sum,dst=1]": (
            lambda x, a: C.reduce(x, a, 1),
            lambda xs: oracle.reduce(xs, "sum", 1),
        ),
        "broadcast[src=1]": (lambda x, a: C.broadcast(x, a, 1), lambda xs: oracle.broadcast(xs, 1)),
        "all_gather": (lambda x, a: C.all_gather(x, a), lambda xs: oracle.all_gather(xs, False)),
        "all_gather[tiled]": (
            lambda x, a: C.all_gather(x, a, tiled=True),
            lambda xs: oracle.all_gather(xs, True),
        ),
        "gather[dst=0]": (lambda x, a: C.gather(x, a, 0), lambda xs: oracle.gather(xs, 0)),
        "scatter[src=1,tiled]": (
            lambda x, a: C.scatter(x, a, 1, tiled=True),
            lambda xs: oracle.scatter(xs, 1, True),
        ),
        "reduce_scatter[sum,tiled]": (
            lambda x, a: C.reduce_scatter(x, a, tiled=True),
            lambda xs: oracle.reduce_scatter(xs, "sum", True),
        ),
        "reduce_scatter[avg,tiled]": (
            lambda x, a: C.reduce_scatter(x, a, "avg", tiled=True),
            lambda xs: oracle.reduce_scatter(xs, "avg", True),
        ),
        "all_to_all[tiled]": (lambda x, a: C.all_to_all(x, a, tiled=True), oracle.all_to_all_tiled),
        "all_to_all[split=1]": (
            lambda x, a: C.all_to_all(x.reshape((ROWS, n, 3)), a, 1, 0),
            lambda xs: oracle.all_to_all_untiled([x.reshape((ROWS, n, 3)) for x in xs], 1, 0),
        ),
        "sendrecv": (lambda x, a: C.sendrecv(x, a, pairs), lambda xs: oracle.sendrecv(xs, pairs)),
        "shift[+1]": (lambda x, a: C.shift(x, a, 1), lambda xs: oracle.shift(xs, 1)),
    }


def _numeric_grad(ref, xs, weights):
    """Finite difference of F = sum_r <W_r, ref(xs)_r> in float64 (exact: ref is linear)."""
    xs = [x.astype(np.float64) for x in xs]

    def F(xs_):
        return sum(float(np.sum(w * np.asarray(o, np.float64))) for w, o in zip(weights, ref(xs_)))

    base = F(xs)
    grads = [np.zeros_like(x) for x in xs]
    for r, x in enumerate(xs):
        for idx in np.ndindex(x.shape):
            bumped = [y.copy() for y in xs]
            bumped[r][idx] += 1.0
            grads[r][idx] = F(bumped) - base
    return grads


@pytest.mark.parametrize("config", ["n3", "n4", "2d-both"])
def test_grad_matches_finite_differences(config):
    if config == "2d-both":
        mesh, axis, spec = mesh_2d(), ("node", "local"), P(("node", "local"))
    else:
        n_ = int(config[1:])
        mesh, axis, spec = mesh_1d(n_), "x", P("x")
    n = mesh.devices.size
    rng = np.random.default_rng(n)
    xs = [rng.normal(size=(ROWS * n, 3)).astype(np.float32) for _ in range(n)]
    failures = []
    for name, (op, ref) in _ops(n).items():
        out_shape = np.asarray(ref(xs)[0]).shape
        weights = [rng.normal(size=out_shape).astype(np.float32) for _ in range(n)]
        w_glob = np.concatenate(weights, 0)

        def F(x_glob, op=op, w_glob=w_glob):
            out = jax.shard_map(lambda x: op(x, axis), mesh=mesh, in_specs=spec, out_specs=spec)(
                x_glob
            )
            return jnp.sum(out * w_glob)

        x_glob = jax.device_put(np.concatenate(xs, 0), NamedSharding(mesh, spec))
        try:
            got = np.asarray(jax.jit(jax.grad(F))(x_glob)).reshape((n, ROWS * n, 3))
        except Exception as err:  # report every op, not only the first that fails
            failures.append(f"{name}: {type(err).__name__}: {str(err)[:200]}")
            continue
        expected = np.stack(_numeric_grad(ref, xs, weights))
        if not np.allclose(got, expected, rtol=1e-4, atol=1e-4):
            failures.append(f"{name}: max error {np.max(np.abs(got - expected)):.3g}")
    assert not failures, failures


def test_grad_eager_broadcast_sums_cotangents_onto_src():
    mesh = mesh_1d(4)
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    w = jnp.array([1.0, 2.0, 3.0, 4.0])

    def F(v):
        return jnp.sum(
            w
            * jax.shard_map(
                lambda y: C.broadcast(y, "x", 2), mesh=mesh, in_specs=P("x"), out_specs=P("x")
            )(v)
        )

    np.testing.assert_array_equal(np.asarray(jax.grad(F)(x)), [0.0, 0.0, 10.0, 0.0])


def test_finite_difference_oracle_can_fail():
    """A gradient that forgets the 1/n of AVG is caught by the same comparison."""
    n = 4
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(ROWS * n, 3)) for _ in range(n)]
    weights = [rng.normal(size=(ROWS * n, 3)) for _ in range(n)]
    avg = np.stack(_numeric_grad(lambda v: oracle.all_reduce(v, "avg"), xs, weights))
    total = np.stack(_numeric_grad(lambda v: oracle.all_reduce(v, "sum"), xs, weights))
    assert not np.allclose(avg, total, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(avg * n, total, rtol=1e-9)
