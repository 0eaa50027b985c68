"""dp.Nnx: nnx modules as users write them (nnx.Rngs, dropout, call arguments), trained
data-parallel, equal to one device, and handed back as an nnx module (trainer.to_module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxcoll import dp
from tests.dp._models import batches, oracle, twin_diffs, twin_loss, twin_optimizer
from tests.helpers import mesh_1d

TOL = 1e-5


class Net(nnx.Module):
    def __init__(self, rngs, axis_name):
        self.l1 = nnx.Linear(16, 16, use_bias=False, rngs=rngs)  # BN cancels a bias
        self.bn = nnx.BatchNorm(16, axis_name=axis_name, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.0, rngs=rngs)  # holds nnx.Rngs state; rate 0: exact
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


class NetTwin(nnx.Module):
    """An Adam copy and a plain-SGD copy (tests/dp/_models.Twin, in nnx)."""

    def __init__(self, rngs, axis_name="data"):
        self.adam = Net(rngs, axis_name)
        self.sgd = Net(rngs, axis_name)

    def __call__(self, x):
        return {"adam": self.adam(x), "sgd": self.sgd(x)}


def test_nnx_with_rngs_matches_single_device_adam_and_sgd_and_round_trips():
    data = batches("mlp", 6, 32)
    module = NetTwin(nnx.Rngs(0))
    model = dp.Nnx(module, twin_loss)
    params, ms = model.init()
    single = dp.Nnx(NetTwin(nnx.Rngs(0), axis_name=None), twin_loss)
    opt = twin_optimizer()
    for kw in ({}, {"sync": dp.sync.ZeRO1(), "accum_steps": 2}):
        trainer = dp.Trainer(model, opt, mesh=mesh_1d(8, "data"), **kw)
        state = trainer.init(params, jax.random.key(1), model_state=ms)
        for b in data:
            state, _ = trainer.step(state, b)
        want, want_ms = oracle(single, opt, params, ms, data, accum=kw.get("accum_steps", 1))
        assert max(twin_diffs(state.params, want).values()) <= TOL, kw
        assert max(twin_diffs(state.model_state, want_ms).values()) <= TOL, kw

    # The round trip: an nnx module with the trained params and BatchNorm statistics.
    trained = trainer.to_module(state)
    assert isinstance(trained, NetTwin)
    got = nnx.to_pure_dict(nnx.state(trained, nnx.BatchStat))
    assert max(twin_diffs(got, jax.device_get(state.model_state)).values()) == 0
    assert (
        max(
            twin_diffs(
                nnx.to_pure_dict(nnx.state(trained, nnx.Param)), jax.device_get(state.params)
            ).values()
        )
        == 0
    )
    trained.eval()
    test = batches("mlp", 1, 40, seed=5)[0]
    direct = float(twin_loss(trained(jnp.asarray(test["x"])), test)[0])
    np.testing.assert_allclose(direct, trainer.evaluate(state, [test])["loss"], rtol=1e-5)
    # independent of the state: stepping (donating) it leaves the module usable
    state, _ = trainer.step(state, data[0])
    np.testing.assert_allclose(
        float(twin_loss(trained(jnp.asarray(test["x"])), test)[0]), direct, rtol=1e-6
    )
    # and the module passed to dp.Nnx was never modified
    assert max(twin_diffs(nnx.to_pure_dict(nnx.state(module, nnx.Param)), params).values()) == 0


class Kept(nnx.Module):
    """out = dropout(ones) * w: the mean of out is w / (1 - rate) times the fraction kept."""

    def __init__(self, rngs, *, own_stream=True, flag=False):
        self.w = nnx.Param(jnp.ones(()))
        self.drop = nnx.Dropout(0.5, rngs=rngs if own_stream else None)
        self.flag = flag

    def __call__(self, x, rngs=None, train=None):
        if self.flag:
            return self.drop(x, deterministic=not train) * self.w
        return self.drop(x, rngs=rngs) * self.w


def _kept_loss(out, batch):
    return jnp.mean(out), {"kept": jnp.mean(out != 0)}


CALLS = {
    "Dropout(rngs=Rngs(0))": (lambda: Kept(nnx.Rngs(0)), None),
    "Rngs(params=, dropout=)": (lambda: Kept(nnx.Rngs(params=0, dropout=1)), None),
    "model(x, rngs=rngs)": (
        lambda: Kept(None, own_stream=False),
        lambda m, b, *, train, rngs: m(b["x"], rngs=rngs),
    ),
    "model(x, train=train)": (
        lambda: Kept(nnx.Rngs(0), flag=True),
        lambda m, b, *, train, rngs: m(b["x"], train=train),
    ),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_dropout_is_on_per_rank_reproducible_and_off_in_evaluate(name):
    make, call = CALLS[name]
    x = {"x": np.ones((8, 64), np.float32)}

    model = dp.Nnx(make(), _kept_loss, **({"call": call} if call else {}))
    params, ms = model.init()
    trainer = dp.Trainer(model, optax.sgd(1.0), mesh=mesh_1d(8, "data"))

    def run():
        state = trainer.init(params, jax.random.key(7), model_state=ms)
        state, m1 = trainer.step(state, x)
        w1 = float(state.params["w"])
        state, m2 = trainer.step(state, x)
        return w1, float(m1["kept"]), float(m2["kept"]), trainer.evaluate(state, [x])

    w1, kept1, kept2, results = run()
    assert run()[:3] == (w1, kept1, kept2)  # reproducible (same key, same masks)
    assert 0.3 < kept1 < 0.7 and kept1 != kept2  # on, and a new mask each step
    # per-rank masks: 512 draws, a global fraction k/512; one mask shared by the 8 ranks
    # would give a multiple of 8/512
    assert round(kept1 * 512) % 8 != 0 or round(kept2 * 512) % 8 != 0
    np.testing.assert_allclose(w1, 1.0 - 2.0 * kept1, rtol=1e-6)  # grad = mean(2 * mask)
    assert results["kept"] == 1.0  # evaluation: dropout off
