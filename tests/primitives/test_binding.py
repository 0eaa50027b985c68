"""Every primitive and algorithm under the three ways of binding an axis name.

``jax.shard_map`` (a mesh axis), ``jax.pmap(axis_name=)`` and ``jax.vmap(axis_name=)``, each
plain and jitted, give the NumPy oracle's answer; ``jax.grad`` through every linear op gives
the gradient of an independent reference written on the stacked array (no collectives).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcoll.primitives as C
from tests import helpers
from tests.primitives import oracle

N = 4
A = "i"
ALGS = ("native", "ring", "tree")
BINDINGS = ["shard_map", "shard_map_jit", "pmap", "pmap_jit", "vmap", "vmap_jit"]


def _cases():
    """name -> (per-rank body, oracle on the list of ranks' inputs, linear reference or None).

    The reference takes the stacked inputs ``X`` (n, n, 3) and returns the stacked outputs.
    """
    n = N
    cases = {}
    for alg in ALGS:
        cases[f"sum_{alg}"] = (
            lambda v, a=alg: C.all_reduce(v, A, algorithm=a),
            lambda xs: oracle.all_reduce(xs, "sum"),
            lambda X: jnp.broadcast_to(X.sum(0), X.shape),
        )
        cases[f"avg_{alg}"] = (
            lambda v, a=alg: C.all_reduce(v, A, "avg", algorithm=a),
            lambda xs: oracle.all_reduce(xs, "avg"),
            lambda X: jnp.broadcast_to(X.mean(0), X.shape),
        )
        cases[f"max_{alg}"] = (
            lambda v, a=alg: C.all_reduce(v, A, "max", algorithm=a),
            lambda xs: oracle.all_reduce(xs, "max"),
            None,
        )
        cases[f"prod_{alg}"] = (
            lambda v, a=alg: C.all_reduce(v, A, "product", algorithm=a),
            lambda xs: oracle.all_reduce(xs, "product"),
            None,
        )
        cases[f"reduce_{alg}"] = (
            lambda v, a=alg: C.reduce(v, A, 1, algorithm=a),
            lambda xs: oracle.reduce(xs, "sum", 1),
            lambda X: X.at[1].set(X.sum(0)),
        )
        cases[f"broadcast_{alg}"] = (
            lambda v, a=alg: C.broadcast(v, A, 2, algorithm=a),
            lambda xs: oracle.broadcast(xs, 2),
            lambda X: jnp.broadcast_to(X[2], X.shape),
        )
        cases[f"all_gather_{alg}"] = (
            lambda v, a=alg: C.all_gather(v, A, algorithm=a),
            lambda xs: oracle.all_gather(xs, False),
            lambda X: jnp.broadcast_to(X, (n,) + X.shape),
        )
        cases[f"reduce_scatter_{alg}"] = (
            lambda v, a=alg: C.reduce_scatter(v, A, algorithm=a),
            lambda xs: oracle.reduce_scatter(xs, "sum", False),
            lambda X: X.sum(0),
        )
    cases["gather"] = (
        lambda v: C.gather(v, A, 1),
        lambda xs: oracle.gather(xs, 1),
        lambda X: jnp.zeros((n,) + X.shape).at[1].set(X),
    )
    cases["scatter"] = (
        lambda v: C.scatter(v, A, 2),
        lambda xs: oracle.scatter(xs, 2, False),
        lambda X: X[2],
    )
    cases["all_to_all"] = (
        lambda v: C.all_to_all(v, A),
        lambda xs: oracle.all_to_all_untiled(xs, 0, 0),
        lambda X: jnp.swapaxes(X, 0, 1),
    )
    cases["sendrecv"] = (
        lambda v: C.sendrecv(v, A, [(0, 2), (3, 1)]),
        lambda xs: oracle.sendrecv(xs, [(0, 2), (3, 1)]),
        lambda X: X.at[2].set(X[0]).at[1].set(X[3]),
    )
    cases["shift"] = (
        lambda v: C.shift(v, A, 1),
        lambda xs: oracle.shift(xs, 1),
        lambda X: jnp.roll(X, 1, axis=0),
    )
    return cases


CASES = _cases()
LINEAR = {k: c[2] for k, c in CASES.items() if c[2] is not None}


def bind(binding: str, body):
    """``body`` over stacked inputs ``(N, ...)`` under ``binding`` (see tests.helpers.bind)."""
    return helpers.bind(binding, body, N, A)


def _inputs():
    rng = np.random.default_rng(0)
    return (rng.uniform(0.5, 1.5, (N, N, 3)) * rng.choice([-1, 1], (N, N, 3))).astype(np.float32)


@pytest.mark.parametrize("binding", BINDINGS)
def test_every_op_under_every_binding(binding):
    x = _inputs()
    got = bind(binding, lambda v: {k: c[0](v) for k, c in CASES.items()})(x)
    xs = list(x)
    for name, (_, want, _) in CASES.items():
        expected = np.stack(want(xs))
        np.testing.assert_allclose(
            np.asarray(got[name]), expected, rtol=2e-6, atol=2e-6, err_msg=f"{name} under {binding}"
        )


@functools.cache
def _weights():
    rng = np.random.default_rng(1)
    shapes = jax.eval_shape(
        lambda X: {k: ref(X) for k, ref in LINEAR.items()},
        jax.ShapeDtypeStruct((N, N, 3), jnp.float32),
    )
    return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


@pytest.mark.parametrize("binding", ["shard_map_jit", "pmap", "vmap", "vmap_jit"])
def test_grad_of_every_linear_op_under_every_binding(binding):
    x = _inputs()
    w = _weights()
    f = bind(binding, lambda v: {k: CASES[k][0](v) for k in LINEAR})

    def loss(X):
        return sum(jnp.sum(w[k] * y) for k, y in f(X).items())

    def reference(X):
        return sum(jnp.sum(w[k] * ref(X)) for k, ref in LINEAR.items())

    np.testing.assert_allclose(
        np.asarray(jax.grad(loss)(x)), jax.grad(reference)(x), rtol=1e-5, atol=1e-5
    )


def test_grad_of_each_linear_op_alone_under_vmap():
    """Per op, so a wrong rule is named (the sum above could hide two cancelling errors)."""
    x = _inputs()
    w = _weights()
    for k, ref in LINEAR.items():
        f = jax.vmap(CASES[k][0], axis_name=A)
        got = jax.grad(lambda X, f=f, k=k: jnp.sum(w[k] * f(X)))(x)
        want = jax.grad(lambda X, ref=ref, k=k: jnp.sum(w[k] * ref(X)))(x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=k)
