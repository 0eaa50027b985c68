"""parallel.moe_mlp with a buffer_factor: dropless through a bounded buffer, in rounds. Its
values equal a NumPy oracle of the whole batch and its gradients the one-device run's and the
worst-case buffer's, at balanced and at adversarial routing (every token's first choice one
expert); the compiled exchange moves the bounded buffer, not the worst case; a model whose
router sends every token to expert 0 trains in a dp.Trainer as on one device, nothing
dropped; the arguments it refuses, at trace time."""

from __future__ import annotations

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import dp, parallel
from jaxcoll import nn as pnn
from tests.dp._models import max_rel_diff, token_batches
from tests.parallel.test_experts import B, D, K, S, _inputs, oracle

DROPLESS = dict(score_func="softmax", normalize=False, factor=None)


def _adversarial(args):
    """Every token's first choice expert 0, its second expert 1 (one rank gets every first
    choice): a constant feature in ``x`` the router weighs heavily for those two."""
    x, router, w_in, w_out = args
    x = x.at[..., 0].set(3.0)
    router = router.at[0].set(0.0).at[0, 0].set(10.0).at[0, 1].set(6.0)
    return x, router, w_in, w_out


def _layer(axis_name, buffer_factor):
    def f(x, router, w_in, w_out):
        return parallel.moe_mlp(
            x, router, w_in, w_out, k=K, axis_name=axis_name, data_axis_name=axis_name,
            buffer_factor=buffer_factor,
        )  # fmt: skip

    return f


def _split(n, buffer_factor):
    """The layer over ``n`` devices, jitted: ``((y, kept), grads)``, the layer's output, the
    assignments each expert computed, and the gradients of the whole batch's loss; and its
    mesh and specs."""
    mesh = jax.make_mesh((n,), ("expert",), devices=jax.devices()[:n])
    specs = (P("expert"), P(), P("expert"), P("expert"))
    layer = _layer("expert", buffer_factor)

    def run(x, router, w_in, w_out):
        def loss(x, router, w_in, w_out):
            y, load = layer(x, router, w_in, w_out)
            return jnp.sum(y**2) / (B * S * D) + 0.1 * load.aux / n, (y, load.kept)

        router = jax.lax.pcast(router, "expert", to="varying")
        g, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, router, w_in, w_out)
        return out, (g[0], jax.lax.psum(g[1], "expert"), g[2], g[3])

    out_specs = ((P("expert"), P()), specs)
    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=out_specs)), mesh, specs


def _one_device_grads(args):
    def loss(x, router, w_in, w_out):
        y, load = _layer(None, None)(x, router, w_in, w_out)
        return jnp.mean(y**2) + 0.1 * load.aux

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)


CASES = [  # (devices, buffer_factor, routing): adversarial, 3 of 6 rounds of 2 rows run
    (8, 1.0, "adversarial"),
    (4, 1.5, "balanced"),
]


@pytest.mark.parametrize("n, factor, routing", CASES)
def test_rounds_equal_the_oracle_the_worst_case_buffer_and_one_device(n, factor, routing):
    args = _inputs(3)
    if routing == "adversarial":
        args = _adversarial(args)
    y_want, routed, kept, _ = oracle(*args, **DROPLESS)
    if routing == "adversarial":
        assert routed[0] == B * S  # every token's first choice is expert 0
    step, mesh, specs = _split(n, factor)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    (y, got_kept), got = step(*placed)
    np.testing.assert_allclose(y, y_want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got_kept, routed)  # nothing dropped
    np.testing.assert_array_equal(got_kept, kept)

    (y_worst, _), worst = _split(n, None)[0](*placed)  # the worst-case buffer: one exchange
    np.testing.assert_allclose(y, y_worst, atol=1e-6, rtol=1e-6)
    want = _one_device_grads(args)
    for g, w1, wn in zip(got, want, worst):
        assert max_rel_diff(g, wn) <= 1e-6
        assert max_rel_diff(g, w1) <= 1e-5


def _all_to_all_rows(lowered_text: str) -> set[int]:
    """The rows each all-to-all of the lowered program moves per rank (n chunks x rows)."""
    shapes = re.findall(r"all_to_all.*?-> tensor<(\d+)x(\d+)x\d+xui8>", lowered_text)
    return {int(a) * int(b) for a, b in shapes}


def test_the_exchange_moves_the_bounded_buffer_not_the_worst_case():
    n, factor = 8, 1.0
    t = B * S // n * K  # assignments per device
    per_round = math.ceil(factor * t / n)
    args = _inputs(3)
    step, mesh, specs = _split(n, factor)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    bounded = _all_to_all_rows(step.lower(*placed).as_text())
    worst = _all_to_all_rows(_split(n, None)[0].lower(*placed).as_text())
    # XLA:CPU's exchange: each rank's n chunks of at most per_round rows (the worst case: t)
    assert bounded == {n * per_round} and worst == {n * t}, (bounded, worst)
    assert n * per_round < n * t


# ---------------------------------------------------------------------------- in a Trainer
VOCAB, WIDTH, SEQ, BATCH, STEPS, EXPERTS = 16, 16, 8, 16, 3, 8


def _constant_first_feature(key, shape, dtype=jnp.float32):
    """An embedding whose first feature is 1 for every token (the router's handle)."""
    return nn.initializers.normal(0.5)(key, shape, dtype).at[:, 0].set(1.0)


def _to_expert_zero(key, shape, dtype=jnp.float32):
    """A router that weighs the first feature heavily for expert 0 (then expert 1)."""
    w = nn.initializers.normal(0.1)(key, shape, dtype)
    return w.at[0].set(0.0).at[0, 0].set(8.0).at[0, 1].set(4.0)


class Skewed(nn.Module):
    """An embedding, one MoE layer whose router sends every token to expert 0, a head."""

    buffer_factor: float | None = None

    @nn.compact
    def __call__(self, x):
        h = nn.Embed(VOCAB, WIDTH, embedding_init=_constant_first_feature)(x)
        moe = pnn.MoE(
            EXPERTS, 24, k=2, router_init=_to_expert_zero, buffer_factor=self.buffer_factor
        )
        return nn.Dense(VOCAB)(h + moe(h))


def _loss(buffer_factor):
    model = Skewed(buffer_factor)

    def loss(params, batch, rng=None):
        logits, sown = model.apply({"params": params}, batch["x"], mutable=["intermediates"])
        logp = jax.nn.log_softmax(logits)
        ce = -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))
        metrics = parallel.moe_metrics(sown["intermediates"])
        return ce + 0.1 * metrics["moe_aux"], metrics

    return loss


def test_all_tokens_to_one_expert_train_as_one_device_with_nothing_dropped():
    batches = token_batches(STEPS, BATCH, SEQ, VOCAB)
    boxed = Skewed().init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    params = nn.unbox(boxed)
    tx = optax.sgd(0.5)
    loss = _loss(None)
    first = jax.jit(lambda p, b: loss(p, b)[1])(params, batches[0])
    assert float(first["moe_imbalance"]) > 3.0  # expert 0 gets every token's first choice
    grad = jax.jit(jax.grad(lambda p, b: loss(p, b)[0]))
    opt = tx.init(params)
    for b in batches:
        updates, opt = tx.update(grad(params, b), opt, params)
        params = optax.apply_updates(params, updates)

    trainer = dp.Trainer(_loss(2.0), tx, layout=dp.Layout(shard=8, expert=8))  # 2 of 4 rounds run
    state = trainer.init(boxed, jax.random.key(0))
    for b in batches:
        state, metrics = trainer.step(state, b)
        assert float(metrics["moe_dropped"]) == 0.0
    assert max_rel_diff(trainer.host_params(state), params) <= 1e-5


BAD = [
    (dict(buffer_factor=0), r"buffer_factor=0 must be a positive number .* or None"),
    (dict(buffer_factor=-1.0), r"buffer_factor=-1.0 must be a positive number"),
    (dict(buffer_factor=float("nan")), r"buffer_factor=nan must be a positive number"),
    (dict(buffer_factor=True), r"buffer_factor=True must be a positive number"),
    (
        dict(buffer_factor=2.0, capacity_factor=1.0),
        r"buffer_factor=2.0 bounds the dropless exchange, and capacity_factor=1.0 .* pass one",
    ),
    (
        dict(buffer_factor=2.0, hierarchical=True),
        r"buffer_factor=2.0 bounds the flat exchange; .* hierarchical=False, or buffer_factor",
    ),
]


@pytest.mark.parametrize("kwargs, match", BAD)
def test_bad_buffer_factors_are_refused_at_trace_time(kwargs, match):
    x, router, w_in, w_out = _inputs()
    with pytest.raises(ValueError, match=r"^parallel\.moe_mlp: " + match):
        jax.jit(lambda *a: parallel.moe_mlp(*a, k=K, **kwargs)).trace(x, router, w_in, w_out)
