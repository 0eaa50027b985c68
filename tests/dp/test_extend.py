"""Extending the step: the loss sees the step and the params; extra state (EMA) updated each
step; non-finite steps skipped (skip_nonfinite, optax.apply_if_finite); optax.MultiSteps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcoll import dp
from tests.dp._models import MLP, batches, cross_entropy, max_rel_diff, oracle
from tests.helpers import mesh_1d

TOL = 1e-5


def _linear(w, batch, rng):
    err = batch["x"] @ w["w"] + w["b"] - batch["y"]
    return jnp.mean(err**2), {}


def _data(k=4, size=32, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(size, 3)).astype(np.float32),
            "y": rng.normal(size=(size,)).astype(np.float32),
        }
        for _ in range(k)
    ]


W0 = {"w": np.array([0.5, -1.0, 2.0], np.float32), "b": np.zeros((), np.float32)}


def _single(optimizer, data, loss=_linear):
    """Plain optax on one device on the whole global batches: the params after each step."""

    @jax.jit
    def step(params, opt_state, batch):
        g = jax.grad(lambda p: loss(p, batch, None)[0])(params)
        updates, opt_state = optimizer.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state, out = jax.tree_util.tree_map(jnp.asarray, W0), optimizer.init(W0), []
    for batch in data:
        params, opt_state = step(params, opt_state, batch)
        out.append(jax.device_get(params))
    return out


def test_the_loss_sees_the_step_in_step_accumulation_and_evaluate():
    def loss_fn(w, batch, rng, *, step):
        value, _ = _linear(w, batch, rng)
        return value, {"step_seen": step.astype(jnp.float32)}

    class Custom(dp.Model):  # a hand-written dp.Model gets the step the same way
        def init(self, rng, batch):
            return W0, {}

        def loss_fn(self, params, model_state, batch, rng, *, step):
            value, metrics = loss_fn(params, batch, rng, step=step)
            return value, (metrics, model_state)

    for model, kw in ((loss_fn, {}), (loss_fn, {"accum_steps": 2}), (Custom(), {})):
        trainer = dp.Trainer(model, optax.sgd(0.1), mesh=mesh_1d(8, "data"), **kw)
        state = trainer.init(W0, jax.random.key(0))
        seen = []
        for batch in _data(3):
            state, m = trainer.step(state, batch)
            seen.append(float(m["step_seen"]))
        assert seen == [0.0, 1.0, 2.0], kw  # the steps taken before this one
        assert trainer.evaluate(state, _data(1))["step_seen"] == 3.0


def test_linen_loss_with_weight_decay_on_params_and_a_step_schedule_matches_one_device():
    wd = 0.1  # large, so a missing or doubled penalty shows
    schedule = optax.linear_schedule(0.1, 0.0, 20)

    def l2(params):
        return (
            0.5 * wd * sum(jnp.sum(w**2) for w in jax.tree_util.tree_leaves(params) if w.ndim > 1)
        )

    def loss(logits, batch, *, params, step):  # flax's ImageNet loss, written for dp.Linen
        value, metrics = cross_entropy(logits, batch)
        return value + l2(params), {**metrics, "learning_rate": schedule(step)}

    def loss_no_step(logits, batch, *, params):
        return loss(logits, batch, params=params, step=jnp.zeros((), jnp.int32))

    data = batches("mlp", 5, 32)
    model = dp.Linen(MLP(), loss)
    params, ms = model.init(jax.random.key(0), data[0])
    sgd = optax.sgd(schedule)  # plain SGD: the params are linear in the gradient
    trainer = dp.Trainer(model, sgd, mesh=mesh_1d(8, "data"))
    state = trainer.init(params, jax.random.key(1))
    lrs = []
    for b in data:
        state, m = trainer.step(state, b)
        lrs.append(float(m["learning_rate"]))
    np.testing.assert_allclose(lrs, [0.1 * (1 - s / 20) for s in range(5)], rtol=1e-6)
    want, _ = oracle(dp.Linen(MLP(), loss_no_step), sgd, params, ms, data)
    assert max_rel_diff(state.params, want) <= TOL
    without, _ = oracle(dp.Linen(MLP(), cross_entropy), sgd, params, ms, data)
    assert max_rel_diff(state.params, without) > 100 * TOL  # the penalty really acts


@pytest.mark.parametrize("sync", [dp.sync.DDP(), dp.sync.ZeRO1()], ids=["ddp", "zero1"])
def test_ema_extra_state_follows_the_params_every_step(sync):
    sgd = optax.sgd(0.1)
    decay = lambda step: 1.0 - 1.0 / (1.0 + step)  # noqa: E731 - a running mean of params
    trainer = dp.Trainer(_linear, sgd, mesh=mesh_1d(8, "data"), extra=dp.ema(decay), sync=sync)
    state = trainer.init(W0, jax.random.key(0))
    np.testing.assert_array_equal(state.extra["w"], W0["w"])
    data = _data(4)
    for batch in data:
        state, _ = trainer.step(state, batch)
    # decay(s) = 1 - 1/(1+s) with s the steps taken including this one: the EMA after k
    # steps is the mean of params_0 (the initial ones) .. params_k.
    traj = _single(sgd, data)
    want = jax.tree_util.tree_map(lambda *p: np.mean(p, axis=0), W0, *traj)
    assert max_rel_diff(state.extra, want) <= TOL
    assert max_rel_diff(state.params, traj[-1]) <= TOL
    assert max_rel_diff(state.extra, traj[-1]) > 100 * TOL
    # the EMA evaluates like any params
    ema = trainer.evaluate(state.replace(params=state.extra), data[:1])["loss"]
    np.testing.assert_allclose(ema, _linear(want, data[0], None)[0], rtol=1e-5)


def _check_bad_step_keeps_the_state(name, trainer, extra=False):
    """Step a good batch, a batch with an inf (on rank 1), a good batch."""
    good = _data(3)
    bad = {"x": good[0]["x"].copy(), "y": good[0]["y"]}
    bad["x"][5, 1] = np.inf  # one example on rank 1: the global gradient is not finite
    state = trainer.init(W0, jax.random.key(0))
    state, m0 = trainer.step(state, good[0])
    before = jax.device_get(state)
    state, m1 = trainer.step(state, bad)
    assert not np.isfinite(float(m1["loss"])), name
    after = jax.device_get(state)
    assert int(after.step) == 2, name  # the data position still advances
    for a, b in zip(
        jax.tree_util.tree_leaves(after.params), jax.tree_util.tree_leaves(before.params)
    ):
        np.testing.assert_array_equal(a, b, err_msg=name)
    state, m2 = trainer.step(state, good[1])  # training goes on from the good state
    want = _single(optax.sgd(0.1), [good[0], good[1]])[-1]
    assert max_rel_diff(state.params, want) <= TOL, name
    return (before, after), (m0, m1, m2)


def test_skip_nonfinite_keeps_params_optimizer_and_extra_state_on_a_bad_step():
    trainer = dp.Trainer(
        _linear, optax.sgd(0.1), mesh=mesh_1d(8, "data"), skip_nonfinite=True, extra=dp.ema(0.5)
    )
    (before, after), metrics = _check_bad_step_keeps_the_state("skip_nonfinite", trainer)
    assert [float(m["skipped"]) for m in metrics] == [0.0, 1.0, 0.0]
    for a, b in zip(
        jax.tree_util.tree_leaves((after.opt_state, after.extra)),
        jax.tree_util.tree_leaves((before.opt_state, before.extra)),
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("sync", [dp.sync.DDP(), dp.sync.ZeRO1()], ids=["ddp", "zero1"])
def test_optax_apply_if_finite_works(sync):
    trainer = dp.Trainer(
        _linear, optax.apply_if_finite(optax.sgd(0.1), 3), mesh=mesh_1d(8, "data"), sync=sync
    )
    _check_bad_step_keeps_the_state("apply_if_finite", trainer)


@pytest.mark.parametrize("sync", [dp.sync.DDP(), dp.sync.ZeRO1()], ids=["ddp", "zero1"])
def test_optax_multisteps_is_accepted_and_matches_one_device(sync):
    def make():
        return optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)

    data = _data(4)
    trainer = dp.Trainer(_linear, make(), mesh=mesh_1d(8, "data"), sync=sync)
    state = trainer.init(W0, jax.random.key(0))
    params = []
    for batch in data:
        state, _ = trainer.step(state, batch)
        params.append(jax.device_get(state.params))
    want = _single(make().gradient_transformation(), data)
    for got, ref in zip(params, want):
        assert max_rel_diff(got, ref) <= TOL
    np.testing.assert_array_equal(params[0]["w"], W0["w"])  # no update until 2 mini-steps
    assert max_rel_diff(params[1], W0) > 1e-3
