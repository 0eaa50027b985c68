"""Buckets are ordered without touching values: an inf stays in its own (frozen) leaf.

One param leaf has an infinite gradient (``sqrt`` at 0) and is frozen by the optimizer
(``multi_transform`` with ``set_to_zero``, or ``masked``), as frozen or masked params are in
practice. With one bucket per leaf, every other leaf's update must equal the single-device
run's, finite: the ordering of the buckets must not carry the inf into later buckets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcoll import dp
from tests.dp._models import max_rel_diff
from tests.helpers import mesh_1d

TOL = 1e-5
BUCKET_MB = 1e-6  # 1 byte: one bucket per leaf


def _loss(params, batch, rng):
    h = jnp.tanh(batch["x"] @ params["a_w"] + params["b_b"])
    err = h @ params["c_v"] - batch["y"]
    # "z_frozen" is the last leaf, so its bucket is the first reduced (reverse order, as DDP).
    # d sqrt(z)/dz at z = 0 is inf: the frozen leaf's gradient is inf on every rank.
    return jnp.mean(err**2) + jnp.sum(jnp.sqrt(params["z_frozen"])), {}


def _params():
    rng = np.random.default_rng(0)
    return {
        "a_w": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32),
        "b_b": jnp.zeros(8, jnp.float32),
        "c_v": jnp.asarray(rng.normal(size=(8, 1)), jnp.float32),
        "z_frozen": jnp.zeros(8, jnp.float32),
    }


def _data(k=4):
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.normal(size=(32, 4)).astype(np.float32),
            "y": rng.normal(size=(32, 1)).astype(np.float32),
        }
        for _ in range(k)
    ]


FREEZE = {
    "multi_transform": lambda: optax.multi_transform(
        {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()},
        {"a_w": "train", "b_b": "train", "c_v": "train", "z_frozen": "frozen"},
    ),
    "masked": lambda: optax.chain(
        optax.masked(
            optax.set_to_zero(), {"a_w": False, "b_b": False, "c_v": False, "z_frozen": True}
        ),
        optax.masked(optax.sgd(0.1), {"a_w": True, "b_b": True, "c_v": True, "z_frozen": False}),
    ),
}


def _single_device(optimizer, params, data):
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: _loss(p, batch, None)[0])(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    for batch in data:
        params, opt_state, grads = step(params, opt_state, batch)
    assert np.isinf(np.asarray(grads["z_frozen"])).all()  # the inf is really there
    return params


@pytest.mark.parametrize(
    "sync",
    [
        dp.sync.DDP(algorithm="native", bucket_mb=BUCKET_MB),
        dp.sync.DDP(algorithm="ring", bucket_mb=BUCKET_MB),
        dp.sync.ZeRO1(bucket_mb=BUCKET_MB),
    ],
    ids=["native", "ring", "zero1"],
)
@pytest.mark.parametrize("freeze", list(FREEZE))
def test_an_inf_in_a_frozen_leaf_stays_there(freeze, sync):
    params, data = _params(), _data()
    assert len(dp.plan_buckets(jax.tree_util.tree_leaves(params), BUCKET_MB * 2**20)) == 4
    want = _single_device(FREEZE[freeze](), params, data)
    trainer = dp.Trainer(_loss, FREEZE[freeze](), mesh=mesh_1d(8, "data"), sync=sync)
    state = trainer.init(params, jax.random.key(0))
    for batch in data:
        state, _ = trainer.step(state, batch)
    got = {k: np.asarray(v) for k, v in state.params.items()}
    np.testing.assert_array_equal(got["z_frozen"], 0.0)
    trained = {k: v for k, v in got.items() if k != "z_frozen"}
    for name, value in trained.items():
        assert np.isfinite(value).all(), (name, value)
    assert max_rel_diff(trained, {k: want[k] for k in trained}) <= TOL
