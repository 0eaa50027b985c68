"""Trainer.step on 8 devices == plain single-device optax on the same global batches.

K = 20 steps, max relative difference of the params <= 1e-5 in float32, for an MLP and a
small CNN with SyncBatchNorm, over bucketing, accum_steps, ZeRO-1 and grad_sync variants.
The negative controls show that the same check fails for the classic mistakes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from jaxcoll import dp
from tests.dp._models import CNN, MLP, batches, cross_entropy, max_rel_diff, oracle
from tests.helpers import mesh_1d

K = 20
TOL = 1e-5
OPT = optax.adam(1e-2)

VARIANTS = {
    "bucketed": {},
    "bucketing-off": {"bucket_mb": None},
    "small-buckets": {"bucket_mb": 0.001},
    "accum4": {"accum_steps": 4},
    "zero1": {"shard_optimizer": True},
    "zero1-accum4": {"shard_optimizer": True, "accum_steps": 4, "bucket_mb": 0.001},
    "native": {"grad_sync": "native"},
    "ring": {"grad_sync": "ring", "bucket_mb": 0.001},
    "tree": {"grad_sync": "tree"},
}

CNN_VARIANTS = ("bucketed", "bucketing-off", "accum4", "zero1")


def _setup(kind):
    mesh = mesh_1d(8, "data")
    data = batches(kind, K, 32)
    module = MLP() if kind == "mlp" else CNN("data")
    model = dp.Linen(module, cross_entropy)
    params, model_state = model.init(jax.random.key(0), data[0])
    single = model if kind == "mlp" else dp.Linen(CNN(None), cross_entropy)
    return mesh, data, model, single, params, model_state


def _train(model, mesh, params, model_state, data, **kw):
    trainer = dp.Trainer(model, OPT, mesh=mesh, **kw)
    state = trainer.init(params, jax.random.key(1), model_state=model_state)
    for batch in data:
        state, _ = trainer.step(state, batch)
    return state


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_trainer_matches_single_device_optax(kind):
    mesh, data, model, single, params, model_state = _setup(kind)
    want = {1: oracle(single, OPT, params, model_state, data, accum=1),
            4: oracle(single, OPT, params, model_state, data, accum=4)}
    for name, kw in VARIANTS.items():
        if kind == "cnn" and name not in CNN_VARIANTS:
            continue
        state = _train(model, mesh, params, model_state, data, **kw)
        want_params, want_ms = want[kw.get("accum_steps", 1)]
        assert max_rel_diff(state.params, want_params) <= TOL, (kind, name)
        if kind == "cnn":  # SyncBatchNorm's running statistics follow the global batch
            assert max_rel_diff(state.model_state, want_ms) <= TOL, (kind, name)
    # Negative control (sgd: Adam is blind to a constant gradient scale): the summed gradient,
    # n times too large, fails the same check that the Trainer passes.
    sgd = optax.sgd(0.05)
    for grad_sync in ("native", "ring"):  # a lax collective and a ppermute-built one
        trainer = dp.Trainer(model, sgd, mesh=mesh, grad_sync=grad_sync)
        good = trainer.init(params, jax.random.key(1), model_state=model_state)
        for batch in data[:5]:
            good, _ = trainer.step(good, batch)
        short = data[:5]
        assert max_rel_diff(good.params, oracle(single, sgd, params, model_state, short)[0]) \
            <= TOL
        bad, _ = oracle(single, sgd, params, model_state, short, grad_scale=8.0)
        assert max_rel_diff(good.params, bad) > 100 * TOL


def test_bf16_gradients_stay_close_and_update_in_float32():
    mesh, data, model, single, params, model_state = _setup("mlp")
    sgd = optax.sgd(0.05)  # Adam would magnify the rounding of near-zero gradients
    want, _ = oracle(single, sgd, params, model_state, data)
    trainer = dp.Trainer(model, sgd, mesh=mesh, grad_dtype=jnp.bfloat16)
    state = trainer.init(params, jax.random.key(1), model_state=model_state)
    for batch in data:
        state, _ = trainer.step(state, batch)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(state.params))
    diff = max_rel_diff(state.params, want)
    assert TOL < diff < 2e-2  # compressed: not exact, but close


def test_gradient_trap_and_fix_against_the_single_device_gradient():
    """Three ways to 'average' inside shard_map, compared with the whole-batch gradient."""
    mesh = mesh_1d(8, "data")
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(5,)), jnp.float32)
    x = rng.normal(size=(32, 5)).astype(np.float32)

    def loss(w, xb):  # per-example mean on whatever batch it gets
        return jnp.mean(jnp.tanh(xb @ w) ** 2)

    want = np.asarray(jax.grad(loss)(w, x))

    def body(w, xb):
        naive = lax.pmean(jax.grad(loss)(w, xb), "data")  # grad already psum'd: the SUM
        wv = lax.pcast(w, "data", to="varying")
        local = jax.grad(loss)(wv, xb)
        summed = C.all_reduce(local, "data", "sum")  # reduced, never divided
        mean = dp.mean_gradients(local, "data", bucket_bytes=None)
        return naive, summed, mean

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    naive, summed, mean = f(w, jax.device_put(x, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(mean, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(naive, 8 * want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(summed, 8 * want, rtol=1e-5, atol=1e-7)
