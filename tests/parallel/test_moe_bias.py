"""Auxiliary-loss-free load balancing (DeepSeek-V3): a routing bias that chooses the experts
(top-k of scores + bias) while the gates stay the unbiased scores, equal to a NumPy oracle;
its update, bias + rate * sign(mean(load) - load), from the whole batch's load; and a
dp.Trainer run with the experts over 8 devices that ends with the biases and params
of the same steps on one device."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxcoll import dp, parallel
from jaxcoll import nn as pnn
from jaxcoll.parallel.moe.metrics import update_expert_bias

E, D, H, K, B, S = 8, 8, 12, 2, 4, 6
_erf = np.vectorize(math.erf)


def _gelu(v):
    return 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)))


def _oracle(x, router, w_in, w_out, bias, *, score_func, normalize):
    """The layer in float64, token by token: experts by score + bias, gates by score."""
    x, router, w_in, w_out, bias = (
        np.asarray(a, np.float64) for a in (x, router, w_in, w_out, bias)
    )
    logits = x @ router
    if score_func == "softmax":
        z = np.exp(logits - logits.max(-1, keepdims=True))
        scores = z / z.sum(-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = np.argsort(-(scores + bias), axis=-1, kind="stable")[..., :K]
    gate = np.take_along_axis(scores, choice, -1)
    if normalize:
        gate = gate / gate.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            for j in range(K):
                e = choice[b, s, j]
                y[b, s] += gate[b, s, j] * (_gelu(x[b, s] @ w_in[e]) @ w_out[e])
    routed = np.bincount(choice.reshape(-1), minlength=E).astype(np.float64)
    return y, routed, np.argsort(-scores, axis=-1, kind="stable")[..., :K]


def _inputs(seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(B, S, D)).astype(np.float32)
    router = r.normal(size=(D, E)).astype(np.float32)
    w_in = (r.normal(size=(E, D, H)) / np.sqrt(D)).astype(np.float32)
    w_out = (r.normal(size=(E, H, D)) / np.sqrt(H)).astype(np.float32)
    bias = (0.3 * r.normal(size=(E,))).astype(np.float32)
    return x, router, w_in, w_out, bias


@pytest.mark.parametrize("score_func, normalize", [("softmax", False), ("sigmoid", True)])
def test_the_bias_chooses_the_experts_and_the_gates_stay_unbiased(score_func, normalize):
    x, router, w_in, w_out, bias = _inputs()
    want, routed, unbiased_choice = _oracle(
        x, router, w_in, w_out, bias, score_func=score_func, normalize=normalize
    )

    def run(x, router, w_in, w_out, bias):
        return parallel.moe_mlp(
            x, router, w_in, w_out, k=K, axis_name=None, score_func=score_func,
            normalize=normalize, bias=bias,
        )  # fmt: skip

    y, load = jax.jit(run)(x, router, w_in, w_out, bias)
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(load.routed), routed)
    # the bias did change the choices (else this test could not tell it was used)
    counts_unbiased = np.bincount(unbiased_choice.reshape(-1), minlength=E)
    assert not np.array_equal(counts_unbiased, routed)
    # and it gets no gradient, while the router does (through the unbiased gates)
    g = jax.grad(lambda r, b: jnp.sum(run(x, r, w_in, w_out, b)[0] ** 2), argnums=(0, 1))
    g_router, g_bias = g(jnp.asarray(router), jnp.asarray(bias))
    assert np.all(np.asarray(g_bias) == 0) and np.max(np.abs(np.asarray(g_router))) > 1e-3


def test_the_update_rule_and_the_layer_that_applies_it():
    routed = np.array([5, 1, 2, 2, 3, 0, 2, 1], np.float32)  # mean 2: equal, under, over
    bias = np.linspace(-0.2, 0.3, E).astype(np.float32)
    load = parallel.Load(jnp.asarray(routed), jnp.asarray(routed), jnp.zeros(()))
    got = update_expert_bias(jnp.asarray(bias), load, 0.01)
    np.testing.assert_allclose(np.asarray(got), bias + 0.01 * np.sign(routed.mean() - routed))

    x, *_ = _inputs(1)
    rate = 0.05
    layer = pnn.MoE(E, H, k=K, axis_name=None, bias_update_rate=rate)
    variables = jax.jit(layer.init)(jax.random.key(0), x)
    np.testing.assert_array_equal(variables["moe_bias"]["bias"], np.zeros(E))
    variables = {**variables, "moe_bias": {"bias": jnp.asarray(bias)}}
    y, new = jax.jit(lambda v: layer.apply(v, x, mutable=["intermediates", "moe_bias"]))(variables)
    p = nn.unbox(variables["params"])
    want, routed, _ = _oracle(
        x, p["router"], p["w_in"], p["w_out"], bias, score_func="softmax", normalize=False
    )
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5, rtol=1e-5)
    expected = bias + rate * np.sign(routed.mean() - routed)
    np.testing.assert_allclose(np.asarray(new["moe_bias"]["bias"]), expected, rtol=1e-6)
    # evaluation (the collection not mutable) reads the bias: the same output, no update
    y_eval = jax.jit(lambda v: layer.apply(v, x))(variables)
    np.testing.assert_array_equal(np.asarray(y_eval), np.asarray(y))


def test_a_rate_that_is_not_positive_is_refused():
    layer = pnn.MoE(E, H, k=K, axis_name=None, bias_update_rate=-0.1)
    with pytest.raises(ValueError, match=r"^MoE.*bias_update_rate=-0.1 must be a positive"):
        layer.init(jax.random.key(0), jnp.zeros((1, S, D)))
    with pytest.raises(ValueError, match=r"bias has shape \(3,\)"):
        parallel.moe_mlp(*_inputs()[:4], k=K, axis_name=None, bias=jnp.zeros(3))


# ------------------------------------------------------------------- in a dp.Trainer
VOCAB, WIDTH, SEQ, BATCH, STEPS, RATE = 16, 16, 8, 16, 4, 0.05


class Tiny(nn.Module):
    """An embedding, a mixture of experts balanced by a routing bias, a head."""

    @nn.compact
    def __call__(self, x, train=False):
        h = nn.Embed(VOCAB, WIDTH)(x)
        moe = pnn.MoE(
            EXPERTS, 24, k=2, router_init=nn.initializers.normal(0.5), bias_update_rate=RATE
        )
        return nn.Dense(VOCAB)(h + moe(h))


EXPERTS = 8


def cross_entropy(logits, batch):
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))


class Balanced(dp.Model):
    """The model's loss, its MoE metrics, and the routing bias as the model state: stepped in
    training, read in evaluation."""

    def __init__(self):
        self.module = Tiny()

    def init(self, rng, batch):
        variables = dict(self.module.init(rng, batch["x"]))
        return variables.pop("params"), variables

    def loss_fn(self, params, model_state, batch, rng):
        mutable = ["intermediates", "moe_bias"] if rng is not None else ["intermediates"]
        logits, new = self.module.apply(
            {"params": params, **model_state}, batch["x"], mutable=mutable
        )
        metrics = parallel.moe_metrics(new["intermediates"])
        state = {"moe_bias": new["moe_bias"]} if rng is not None else model_state
        return cross_entropy(logits, batch), (metrics, state)


def _batches():
    r = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        x = r.integers(0, VOCAB, size=(BATCH, SEQ + 1))
        out.append({"x": x[:, :-1].astype(np.int32), "y": x[:, 1:].astype(np.int32)})
    return out


def _reference(params, model_state):
    """The same steps on one device, plain JAX: SGD on the loss, the bias from the apply."""
    model = Balanced()

    @jax.jit
    def step(params, model_state, batch):
        grad_fn = jax.grad(lambda p: model.loss_fn(p, model_state, batch, 0), has_aux=True)
        grads, (metrics, model_state) = grad_fn(params)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)
        return params, model_state, metrics

    imbalance = []
    for b in _batches():
        params, model_state, metrics = step(params, model_state, b)
        imbalance.append(float(metrics["moe_imbalance"]))
    return params, model_state, imbalance


def test_experts_over_8_devices_step_the_bias_and_params_as_one_device():
    layout = dp.Layout(shard=8, expert=8)  # FSDP over 8, one expert per device
    model = Balanced()
    boxed, model_state = model.init(jax.random.key(0), _batches()[0])
    params = nn.unbox(boxed)
    want_params, want_state, want_imbalance = _reference(params, model_state)
    trainer = dp.Trainer(model, optax.sgd(0.5), layout=layout)
    state = trainer.init(boxed, jax.random.key(1), model_state=model_state)
    imbalance = []
    for b in _batches():
        state, metrics = trainer.step(state, b)
        imbalance.append(float(metrics["moe_imbalance"]))
    np.testing.assert_allclose(imbalance, want_imbalance, rtol=1e-6)
    bias = state.model_state["moe_bias"]["MoE_0"]["bias"]
    copies = [np.asarray(s.data) for s in bias.addressable_shards]
    assert all(np.array_equal(c, copies[0]) for c in copies)  # one bias on every device
    want_bias = np.asarray(want_state["moe_bias"]["MoE_0"]["bias"])
    np.testing.assert_allclose(copies[0], want_bias, atol=1e-5)
    assert np.max(np.abs(want_bias)) >= RATE  # it moved
    got = trainer.host_params(state)
    for a, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=1e-5, rtol=1e-5)
    # evaluation reads the bias and leaves the state as it was
    before = np.asarray(jax.device_get(bias))
    trainer.evaluate(state, _batches()[:1])
    np.testing.assert_array_equal(
        np.asarray(jax.device_get(state.model_state["moe_bias"]["MoE_0"]["bias"])), before
    )


def test_a_bridged_nnx_layer_steps_its_bias_when_the_collection_is_mutable():
    x, *_ = _inputs(2)
    with dp.building():  # the params' split kept as metadata, no mesh
        moe = nnx.bridge.ToNNX(
            pnn.MoE(E, H, k=K, axis_name=None, bias_update_rate=RATE), rngs=nnx.Rngs(0)
        ).lazy_init(x)
    moe(x, mutable=["intermediates"])  # evaluation: read only
    np.testing.assert_array_equal(np.asarray(moe.bias[...]), np.zeros(E))
    moe(x, mutable=["intermediates", "moe_bias"])
    routed = np.asarray(pnn.pop_moe_metrics(moe)["moe_imbalance"])
    bias = np.asarray(moe.bias[...])
    assert routed > 1 and set(np.unique(np.abs(bias))) <= {0.0, np.float32(RATE)}
    assert np.any(bias != 0)


class _NnxNet(nnx.Module):
    """An nnx model with a bridged MoE that steps its bias (a user's model: no jaxcoll calls
    besides the layer)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.moe = nnx.bridge.ToNNX(
            pnn.MoE(num_experts=4, hidden=16, k=2, bias_update_rate=RATE), rngs=rngs
        ).lazy_init(jnp.ones((1, 8, 16)))
        self.head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.moe(self.embed(tokens), mutable=["intermediates", "moe_bias"]))


def test_dp_nnx_carries_a_bridged_layers_bias_as_model_state():
    # dp.Nnx once carried only nnx.BatchStat: the bias's update was dropped every step. And
    # under dp.Layout() (the batch over the mesh's "data") the role "batch" was bound to no
    # axis: each device stepped the bias from its own tokens' load.
    def loss(out, batch):
        return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean(), {}

    with dp.building():
        net = _NnxNet(nnx.Rngs(0))
    trainer = dp.Trainer(dp.Nnx(net, loss, input_key="x"), optax.sgd(0.1), layout=dp.Layout())
    params, model_state = trainer.model.init()
    state = trainer.init(params, jax.random.key(1), model_state=model_state)
    np.testing.assert_array_equal(np.asarray(state.model_state["moe"]["bias"]), np.zeros(4))
    rng = np.random.default_rng(0)
    batch = {"x": rng.integers(0, 32, (8, 8)), "y": rng.integers(0, 32, (8, 8))}
    state, _ = trainer.step(state, batch)
    bias = np.asarray(state.model_state["moe"]["bias"])
    assert np.any(bias != 0)  # each expert's bias stepped by +-RATE, or 0 at the mean load
    assert np.all(np.isclose(np.abs(bias), RATE) | (bias == 0)), bias
