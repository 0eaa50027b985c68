"""Expert parallel inside the Trainer: 20 steps of a model with a mixture-of-experts layer
(jaxcoll.nn.MoE, its auxiliary loss in the loss), its experts split over an expert axis that
borrows the data devices (2, 4, 8; under DDP, FSDP and HSDP; dropless and with a capacity that
drops tokens), equal 20 steps of plain optax on one device, Adam and plain SGD (twin copies);
and the lowered step moves tokens with 2 all-to-alls forward and 2 backward."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcoll import dp, parallel
from jaxcoll import nn as pnn
from tests.dp._models import max_rel_diff, token_batches, twin_optimizer
from tests.parallel.test_experts import BAD_ARGUMENTS

VOCAB, WIDTH, SEQ, BATCH, STEPS, EXPERTS = 16, 16, 8, 16, 20, 8
AUX = 0.1


class Tiny(nn.Module):
    """An embedding, one MoE layer (8 experts, top-2, a shared expert), a head."""

    capacity_factor: float | None = None

    @nn.compact
    def __call__(self, x):
        h = nn.Embed(VOCAB, WIDTH)(x)
        moe = pnn.MoE(
            EXPERTS, 24, k=2, capacity_factor=self.capacity_factor, shared_hidden=8,
            router_init=nn.initializers.normal(0.5),
        )  # fmt: skip
        return nn.Dense(VOCAB)(h + moe(h))


def _loss(capacity_factor):
    model = Tiny(capacity_factor)

    def loss(params, batch, rng=None):
        total, metrics = 0.0, {}
        for copy in ("adam", "sgd"):
            logits, sown = model.apply(
                {"params": params[copy]}, batch["x"], mutable=["intermediates"]
            )
            logp = jax.nn.log_softmax(logits)
            ce = -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))
            metrics = parallel.moe_metrics(sown["intermediates"])
            total += ce + AUX * metrics["moe_aux"]
        return total, metrics

    return loss


def _params(boxed=False):
    x = jnp.zeros((1, SEQ), jnp.int32)
    params = {
        copy: Tiny().init(jax.random.key(i), x)["params"] for i, copy in enumerate(("adam", "sgd"))
    }
    return params if boxed else nn.unbox(params)


def _batches():
    return token_batches(STEPS, BATCH, SEQ, VOCAB)


def _reference(capacity_factor):
    loss = _loss(capacity_factor)
    tx = twin_optimizer()
    params = _params()
    opt = tx.init(params)
    grad = jax.jit(jax.grad(lambda p, b: loss(p, b)[0]))
    metrics = jax.jit(lambda p, b: loss(p, b)[1])
    first = metrics(params, _batches()[0])
    for b in _batches():
        updates, opt = tx.update(grad(params, b), opt, params)
        params = optax.apply_updates(params, updates)
    return jax.device_get(params), jax.device_get(first)


@pytest.fixture(scope="module")
def references():
    return {cf: _reference(cf) for cf in (None, 1.0)}


LAYOUTS = {
    "ep8": (dp.Layout(expert=8), None),  # DDP for the rest
    # alone over 2 and 4 of the 8 devices: DDP over both axes of the mesh, the experts
    # split over one of them (and replicated over the other)
    "ep2": (dp.Layout(replicate=("rep", "ep"), expert="ep"), (4, 2)),
    "ep4": (dp.Layout(replicate=("rep", "ep"), expert="ep"), (2, 4)),
    "fsdp8-ep8": (dp.Layout(shard=8, expert=8), None),
    "hsdp2x4-ep4": (dp.Layout(replicate=2, shard=4, expert=4), None),
    "hsdp4x2-ep2": (dp.Layout(replicate=4, shard=2, expert=2), None),
    "zero1-4x2-ep2": (dp.Layout(replicate=4, shard=2, expert=2), dp.sync.ZeRO1()),
    "fsdp4-ep4-capacity": (dp.Layout(replicate=2, shard=4, expert=4), "capacity"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_layouts_train_as_one_device(name, references):
    layout, extra = LAYOUTS[name]
    cf = 1.0 if extra == "capacity" else None
    sync = extra if isinstance(extra, dp.sync.Strategy) else None
    mesh = jax.make_mesh(extra, ("rep", "ep")) if isinstance(extra, tuple) else None
    reference, first = references[cf]
    trainer = dp.Trainer(_loss(cf), twin_optimizer(), layout=layout, sync=sync, mesh=mesh)
    state = trainer.init(_params(boxed=True), jax.random.key(0))
    for i, b in enumerate(_batches()):
        state, metrics = trainer.step(state, b)
        if i == 0:  # the load over the whole batch, as one device counts it
            for key in ("moe_aux", "moe_dropped", "moe_imbalance"):
                np.testing.assert_allclose(metrics[key], first[key], rtol=1e-5)
    if cf is not None:
        assert float(first["moe_dropped"]) > 0.02  # the capacity does drop tokens
    got = trainer.host_params(state)
    for copy in ("adam", "sgd"):
        assert max_rel_diff(got[copy], reference[copy]) <= 1e-5, copy


def test_the_experts_stay_split_and_the_step_moves_tokens_by_four_all_to_alls():
    trainer = dp.Trainer(_loss(None), optax.sgd(0.1), layout=dp.Layout(shard=8, expert=8))
    state = trainer.init(_params(boxed=True), jax.random.key(0))
    w_in = state.params["adam"]["MoE_0"]["w_in"]
    assert w_in.sharding.shard_shape(w_in.shape) == (1, WIDTH, 24)  # one expert per device
    step, args = trainer.step_program(state, _batches()[0])
    hlo = step.lower(*args).compile().as_text()
    moves = re.findall(r"= \((u8\[[\d,]+\])[^\n]*\) all-to-all\(", hlo)
    # two MoE layers (the twin copies), each 2 all-to-alls forward and 2 backward, every
    # one carrying the tokens (rows of bytes)
    assert len(moves) == 8, moves
    counts = re.findall(r"= s32\[([\d,]+)\][^=]* all-gather\(", hlo)
    # and one small exchange of counts (8 x 8 int32) per layer: the combine and the backward
    # reuse the dispatch's plan
    assert counts == ["8,8", "8,8"], counts


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: dp.Layout(shard=4, expert=2), r"the expert role borrows the devices of the data"),
        (
            lambda: dp.Layout(replicate="data", tensor="model", expert="model"),
            r"must name the axis of the data shards",
        ),
        (lambda: dp.Layout(shard=2, rules={"experts": "shard"}), r"rules map a logical axis"),
    ],
)
def test_an_expert_role_that_borrows_no_data_devices_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_experts_the_expert_axis_does_not_divide_are_named():
    class Five(nn.Module):
        @nn.compact
        def __call__(self, x):
            return pnn.MoE(5, 8, k=2)(nn.Embed(VOCAB, WIDTH)(x))

    model = Five()
    params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]

    def loss(p, batch, rng=None):
        return jnp.mean(model.apply({"params": p}, batch["x"]) ** 2), {}

    trainer = dp.Trainer(loss, optax.sgd(0.1), layout=dp.Layout(shard=8, expert=8))
    with pytest.raises(
        ValueError, match=r"num_experts=5 is not divisible by the 8 ranks of mesh axis 'shard'"
    ):
        trainer.init(params, jax.random.key(0))


@pytest.mark.parametrize("kwargs, match", BAD_ARGUMENTS)
def test_the_layer_refuses_what_moe_mlp_refuses(kwargs, match):
    # one check, in parallel.moe_mlp's body, naming the layer that called it
    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            return pnn.MoE(EXPERTS, 8, **kwargs, name="moe")(x)

    with pytest.raises(ValueError, match=r"^MoE 'moe': " + match):
        Bad().init(jax.random.key(0), jnp.zeros((2, SEQ, WIDTH)))


def test_a_capacity_under_context_parallel_is_refused():
    # each device holds a part of every sequence: a per-sequence capacity cannot be counted
    trainer = dp.Trainer(_loss(1.0), optax.sgd(0.1), layout=dp.Layout(shard=4, context=2, expert=4))
    state = trainer.init(_params(boxed=True), jax.random.key(0))
    with pytest.raises(ValueError, match=r"capacity_factor=1.0 .* the context axis 'context'"):
        trainer.step(state, _batches()[0])


def test_a_checkpoint_moves_between_expert_layouts(tmp_path, references):
    # 10 steps with one expert per device (FSDP over 8), saved; restored into 2 experts per
    # device (HSDP: 2 x FSDP over 4) and 10 more steps: the 20 steps of one device.
    batches = _batches()
    first = dp.Trainer(_loss(None), twin_optimizer(), layout=dp.Layout(shard=8, expert=8))
    state = first.init(_params(boxed=True), jax.random.key(0))
    for b in batches[:10]:
        state, _ = first.step(state, b)
    ckpt = dp.Checkpointer(str(tmp_path / "run"))
    ckpt.save(state)
    ckpt.wait()
    second = dp.Trainer(
        _loss(None), twin_optimizer(), layout=dp.Layout(replicate=2, shard=4, expert=4)
    )
    state = ckpt.restore(10, second.init(_params(boxed=True), jax.random.key(0)))
    w_in = state.params["adam"]["MoE_0"]["w_in"]
    assert w_in.sharding.shard_shape(w_in.shape)[0] == 2  # two experts per device now
    for b in batches[10:]:
        state, _ = second.step(state, b)
    got, want = second.host_params(state), references[None][0]
    for copy in ("adam", "sgd"):
        assert max_rel_diff(got[copy], want[copy]) <= 1e-5, copy
