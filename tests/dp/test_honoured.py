"""A layout role the model does not honour is refused before the first step; a model written
for GSPMD (no collectives, kernels split by their specs) trains under a tensor role equal to
one device, its kernels really split; annotations and partition rules are the model specs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcoll import dp, parallel

RNG = np.random.default_rng(0)
BATCHES = [
    {
        "x": RNG.normal(size=(16, 8, 16)).astype(np.float32),
        "y": RNG.normal(size=(16, 8, 4)).astype(np.float32),
    }
    for _ in range(3)
]


def mlp_params(key):
    k1, k2 = jax.random.split(key)
    return {
        "up": jax.random.normal(k1, (16, 32)) * 0.3,
        "down": jax.random.normal(k2, (32, 4)) * 0.3,
    }


def gspmd_loss(p, batch, rng):
    """A model with no collectives: XLA inserts the tensor axis's reductions."""
    h = jnp.tanh(batch["x"] @ p["up"])
    return jnp.mean((h @ p["down"] - batch["y"]) ** 2), {}


def explicit_loss(p, batch, rng):
    """A model that runs its own row-parallel reduction (Megatron style)."""
    h = jnp.tanh(parallel.column_parallel(batch["x"], p["up"]))
    return jnp.mean((parallel.row_parallel(h, p["down"]) - batch["y"]) ** 2), {}


def self_attention_loss(p, batch, rng):
    """Attention written by hand: under a context role each device would see its own part."""
    h = batch["x"] @ p["up"]
    w = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", h, h) / 8.0, axis=-1)
    out = jnp.einsum("bqk,bkd->bqd", w, h) @ p["down"]
    return jnp.mean((out - batch["y"]) ** 2), {}


def one_device(loss, params, steps, lr=0.1):
    opt = optax.sgd(lr)
    state = opt.init(params)
    losses = []
    for b in BATCHES[:steps]:
        value, g = jax.value_and_grad(lambda q, b=b: loss(q, b, None)[0])(params)
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return losses, params


SPECS = {"up": P(None, "mlp"), "down": P("mlp", None)}


@pytest.mark.parametrize("name", ["fsdp4xtp2", "dp2xtp4"])
def test_gspmd_model_under_tensor_parallel_equals_one_device_with_kernels_split(name):
    params = mlp_params(jax.random.key(0))
    want_losses, want = one_device(gspmd_loss, params, 3)
    trainer = dp.Trainer(gspmd_loss, optax.sgd(0.1), layout=dp.Layout.parse(name))
    state = trainer.init(params, jax.random.key(1), specs=SPECS)
    losses = []
    for b in BATCHES:
        state, m = trainer.step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    got = trainer.host_params(state)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    t = trainer.mesh.shape["tensor"]
    # The split is real: each device holds 1/t of the hidden dim of both kernels.
    up = state.params["up"].addressable_shards[0].data.shape
    down = state.params["down"].addressable_shards[0].data.shape
    assert up[1] == 32 // t and down[0] == 32 // t, (up, down)


def test_partition_rules_and_mesh_names_mapped_by_the_layout():
    params = mlp_params(jax.random.key(0))
    rules = [(r"up$", P("fsdp", "mp")), (r"down", P("mp", "fsdp")), (r".*", P())]
    layout = dp.Layout(shard=4, tensor=2, rules={"mp": "tensor", "fsdp": None})
    trainer = dp.Trainer(gspmd_loss, optax.sgd(0.1), layout=layout)
    state = trainer.init(params, jax.random.key(1), specs=rules)
    assert state.params["up"].addressable_shards[0].data.shape[1] == 16
    want_losses, _ = one_device(gspmd_loss, params, 2)
    for b, want in zip(BATCHES[:2], want_losses, strict=True):
        state, m = trainer.step(state, b)
        np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)


def test_a_name_the_layout_does_not_know_is_refused_naming_the_rule():
    params = mlp_params(jax.random.key(0))
    trainer = dp.Trainer(gspmd_loss, optax.sgd(0.1), layout=dp.Layout(shard=4, tensor=2))
    with pytest.raises(ValueError, match=r"'mp'.*rules=\{'mp': 'tensor'\}"):
        trainer.init(params, jax.random.key(1), specs={"up": P(None, "mp"), "down": P()})


def test_a_partition_rule_that_matches_no_param_is_named():
    trainer = dp.Trainer(gspmd_loss, optax.sgd(0.1), layout=dp.Layout(shard=4, tensor=2))
    with pytest.raises(ValueError, match=r"no partition rule matches the param 'down'"):
        trainer.init(mlp_params(jax.random.key(0)), jax.random.key(1), specs=[("up", P())])


def test_tensor_role_with_no_param_split_is_refused():
    """The first silent case: under Layout(shard=4, tensor=2) without specs every kernel stayed
    whole and the row-parallel all-reduce summed two copies (loss 6.897 for 7.500)."""
    trainer = dp.Trainer(explicit_loss, optax.sgd(0.1), layout=dp.Layout(shard=4, tensor=2))
    with pytest.raises(ValueError, match=r"tensor role over 'tensor'.*no param is split"):
        trainer.init(mlp_params(jax.random.key(0)), jax.random.key(1))


def test_row_parallel_over_whole_kernels_is_refused():
    """A param split (one the layers below never read), the row-parallel kernel whole: its
    reduction would count each device's copy once."""
    trainer = dp.Trainer(explicit_loss, optax.sgd(0.1), layout=dp.Layout(shard=4, tensor=2))
    params = {**mlp_params(jax.random.key(0)), "unused": jnp.zeros((2, 8))}
    specs = {"up": P(), "down": P(), "unused": P("tensor")}
    state = trainer.init(params, jax.random.key(1), specs=specs)
    with pytest.raises(ValueError, match=r"row_parallel: its inputs h and w are the same"):
        trainer.step(state, BATCHES[0])


def test_explicit_tensor_parallel_model_still_runs_by_hand_equal_to_one_device():
    params = mlp_params(jax.random.key(0))
    want_losses, _ = one_device(gspmd_loss, params, 2)
    trainer = dp.Trainer(explicit_loss, optax.sgd(0.1), layout=dp.Layout(shard=4, tensor=2))
    specs = {"up": P(None, "tensor"), "down": P("tensor")}
    state = trainer.init(params, jax.random.key(1), specs=specs)
    for b, want in zip(BATCHES[:2], want_losses, strict=True):
        state, m = trainer.step(state, b)
        np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)


def test_context_role_with_the_models_own_attention_is_refused():
    """The second silent case: each device attended within its own chunk (7.377 for 7.500)."""
    layout = dp.Layout(shard=2, context=4)
    trainer = dp.Trainer(self_attention_loss, optax.sgd(0.1), layout=layout)
    state = trainer.init(mlp_params(jax.random.key(0)), jax.random.key(1))
    with pytest.raises(ValueError, match=r"context role.*never computed attention"):
        trainer.step(state, BATCHES[0])


def test_pipeline_role_the_model_never_runs_is_refused():
    trainer = dp.Trainer(
        gspmd_loss,
        optax.sgd(0.1),
        layout=dp.Layout(replicate=4, pipeline=2, schedule=parallel.GPipe(2)),
    )
    params = {"up": jnp.zeros((2, 16, 32)), "down": jnp.zeros((2, 32, 4))}
    state = trainer.init(params, jax.random.key(1), specs={"up": P("layers"), "down": P("layers")})
    with pytest.raises(ValueError, match=r"pipeline role.*never ran a pipeline"):
        trainer.step(state, BATCHES[0])


def test_expert_role_the_model_never_routes_is_refused():
    trainer = dp.Trainer(gspmd_loss, optax.sgd(0.1), layout=dp.Layout(shard=8, expert=8))
    state = trainer.init(mlp_params(jax.random.key(0)), jax.random.key(1))
    with pytest.raises(ValueError, match=r"expert role.*never routed"):
        trainer.step(state, BATCHES[0])


def test_flags_must_be_bools():
    with pytest.raises(TypeError, match=r"skip_nonfinite must be True or False, got 'no'"):
        dp.Trainer(gspmd_loss, optax.sgd(0.1), skip_nonfinite="no")
    trainer = dp.Trainer(gspmd_loss, optax.sgd(0.1))
    state = trainer.init(mlp_params(jax.random.key(0)), jax.random.key(1))
    with pytest.raises(TypeError, match=r"prefetch must be True or False, got 'yes'"):
        trainer.fit(state, BATCHES, steps=1, prefetch="yes")
    with pytest.raises(ValueError, match=r"steps=-1 is negative"):
        trainer.fit(state, BATCHES, steps=-1)
