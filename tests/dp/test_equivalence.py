"""Trainer.step on 8 devices == plain single-device optax on the same global batches.

K = 20 steps, max relative difference of the params <= 1e-5 in float32, for an MLP and a
small CNN with SyncBatchNorm, over every dp.sync strategy (DDP, ZeRO1, FSDP), bucketing,
accum_steps and every collective algorithm. Each
model is a twin (tests/dp/_models.Twin): one copy trained by Adam, one by plain SGD, in the
same program, each compared with the oracle on its own. SGD's params are linear in the
gradient, so a constant gradient-scale error (n, n/(n-1)) that Adam hides fails the SGD copy.
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
from tests.dp._models import (
    CNN,
    MLP,
    Twin,
    batches,
    cross_entropy,
    max_rel_diff,
    oracle,
    twin_diffs,
    twin_loss,
    twin_optimizer,
)
from tests.helpers import mesh_1d, mesh_2d

K = 20
TOL = 1e-5
OPT = twin_optimizer()

DDP, ZERO1, FSDP = dp.sync.DDP, dp.sync.ZeRO1, dp.sync.FSDP
VARIANTS = {
    "bucketed": {"sync": DDP()},
    "bucketing-off": {"sync": DDP(bucket_mb=None)},
    "small-buckets": {"sync": DDP(bucket_mb=0.001)},
    "accum4": {"accum_steps": 4},
    "zero1": {"sync": ZERO1()},
    "zero1-accum4": {"sync": ZERO1(bucket_mb=0.001), "accum_steps": 4},
    "fsdp": {"sync": FSDP()},
    "fsdp-accum4-ring": {"sync": FSDP(algorithm="ring", bucket_mb=0.001), "accum_steps": 4},
    # "auto" picks "native" on CPU at these sizes: "bucketed" is the native variant
    "ring": {"sync": DDP(algorithm="ring", bucket_mb=0.001)},
    "tree": {"sync": DDP(algorithm="tree")},
    "hierarchical": {
        "sync": DDP(algorithm="hierarchical"),
        "layout": dp.Layout(replicate=("node", "local")),
    },
}

CNN_VARIANTS = ("bucketed", "bucketing-off", "accum4", "zero1", "fsdp")


def _setup(kind):
    data = batches(kind, K, 32)
    # CNN with 8 features: ZeRO-1 splits its conv, BatchNorm and dense leaves over 8 devices
    module = Twin(MLP) if kind == "mlp" else Twin(CNN, ("data", 8))
    model = dp.Linen(module, twin_loss)
    params, model_state = model.init(jax.random.key(0), data[0])
    single = model if kind == "mlp" else dp.Linen(Twin(CNN, (None, 8)), twin_loss)
    return data, model, single, params, model_state


def _train(model, params, model_state, data, optimizer=OPT, **kw):
    two_level = "layout" in kw
    mesh = mesh_2d(2, 4) if two_level else mesh_1d(8, "data")
    trainer = dp.Trainer(model, optimizer, mesh=mesh, **kw)
    state = trainer.init(params, jax.random.key(1), model_state=model_state)
    for batch in data:
        state, _ = trainer.step(state, batch)
    return state


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_trainer_matches_single_device_optax_adam_and_sgd(kind):
    data, model, single, params, model_state = _setup(kind)
    want = {
        1: oracle(single, OPT, params, model_state, data, accum=1),
        4: oracle(single, OPT, params, model_state, data, accum=4),
    }
    failures, states = {}, {}
    for name, kw in VARIANTS.items():
        if kind == "cnn" and name not in CNN_VARIANTS:
            continue
        state = states[name] = _train(model, params, model_state, data, **kw)
        want_params, want_ms = want[kw.get("accum_steps", 1)]
        diffs = {f"params[{k}]": d for k, d in twin_diffs(state.params, want_params).items()}
        if kind == "cnn":  # SyncBatchNorm's running statistics follow the global batch
            diffs.update(
                {f"batch_stats[{k}]": d for k, d in twin_diffs(state.model_state, want_ms).items()}
            )
        bad = {k: d for k, d in diffs.items() if not d <= TOL}
        if bad:
            failures[name] = bad
    assert not failures, f"max relative difference above {TOL}: {failures}"
    # Negative control: the summed gradient, n times too large, fails the same check that
    # the Trainer passes (for a lax collective and a ppermute-built one where both ran).
    bad, _ = oracle(single, OPT, params, model_state, data, grad_scale=8.0)
    for name in ("bucketed", "ring"):
        if name in states:
            assert twin_diffs(states[name].params, bad)["sgd"] > 100 * TOL, name


def test_bf16_gradients_stay_close_and_update_in_float32():
    mesh = mesh_1d(8, "data")
    data = batches("mlp", K, 32)
    model = dp.Linen(MLP(), cross_entropy)
    params, model_state = model.init(jax.random.key(0), data[0])
    sgd = optax.sgd(0.05)  # Adam would magnify the rounding of near-zero gradients
    want, _ = oracle(model, sgd, params, model_state, data)
    trainer = dp.Trainer(
        model, sgd, mesh=mesh, sync=dp.sync.DDP(hook=dp.hooks.Compress(jnp.bfloat16))
    )
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
