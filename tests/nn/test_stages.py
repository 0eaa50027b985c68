"""``jaxcoll.nn.stack_blocks``: an nnx model's list of blocks as pipeline stages, the model
file unchanged. The model below is written as nnx users write one (blocks in an ``nnx.List``
called in a for loop, logical sharding metadata on the params, per-token inputs: packed
sequences); a few lines of glue train it in a ``dp.Trainer`` with a pipeline layout, equal to
a jitted optax loop on one device over the model's own ``__call__``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcoll import dp, parallel
from jaxcoll import nn as jnn

VOCAB, WIDTH, LAYERS, SEQ = 13, 16, 4, 16
STEPS, LR = 10, 0.1


# ------------------------------------------------------------------ the user's model (unchanged)
class Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(
            width,
            3 * width,
            use_bias=False,
            kernel_init=nnx.with_partitioning(init, ("embed", "heads")),
            rngs=rngs,
        )
        self.out = nnx.Linear(
            width,
            width,
            use_bias=False,
            kernel_init=nnx.with_partitioning(init, ("heads", "embed")),
            rngs=rngs,
        )

    def __call__(self, h, *, positions, segment_ids):
        q, k, v = jnp.split(self.qkv(self.norm(h)), 3, axis=-1)
        # Attention within a sequence of the packed row, causal by position.
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        causal = positions[:, :, None] >= positions[:, None, :]
        scores = jnp.where(same & causal, q @ k.swapaxes(1, 2) / np.sqrt(h.shape[-1]), -1e9)
        return h + self.out(jax.nn.softmax(scores, axis=-1) @ v)


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(
            VOCAB,
            WIDTH,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.5), ("vocab", "embed")),
            rngs=rngs,
        )
        self.pos = nnx.Embed(SEQ, WIDTH, rngs=rngs)
        self.layers = nnx.List([Block(WIDTH, rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens, positions, segment_ids):
        h = self.embed(tokens) + self.pos(positions)
        for block in self.layers:
            h = block(h, positions=positions, segment_ids=segment_ids)
        return self.head(self.norm(h))


def make_model():
    with nnx.use_eager_sharding(False):  # the metadata kept, nothing placed (no mesh here)
        return Model(nnx.Rngs(0))


def xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1))


def packed(rows, seed):
    """Rows of 2-3 sequences, positions restarting per sequence."""
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((rows, SEQ), np.int32), np.zeros((rows, SEQ), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, SEQ), rng.integers(1, 3), replace=False))
        for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, SEQ], strict=True)):
            seg[r, a:b], pos[r, a:b] = i, np.arange(b - a)
    tokens = rng.integers(0, VOCAB, size=(rows, SEQ)).astype(np.int32)
    return {"tokens": tokens, "pos": pos, "seg": seg, "y": np.roll(tokens, -1, axis=1)}


# ------------------------------------------------------------------ the stack, piece by piece
def test_the_stack_is_the_model_s_loop_with_its_specs():
    model = make_model()
    stack = jnn.stack_blocks(model.layers)
    assert stack.params["qkv"]["kernel"].shape == (LAYERS, WIDTH, 3 * WIDTH)
    assert stack.specs["qkv"]["kernel"] == P("layers", "embed", "heads")
    assert stack.specs["out"]["kernel"] == P("layers", "heads", "embed")
    assert stack.specs["norm"]["scale"] == P("layers")
    batch = packed(2, 0)
    h = model.embed(batch["tokens"])
    side = {"positions": batch["pos"], "segment_ids": batch["seg"]}

    @jax.jit
    def loop(h):  # the model's own loop
        for block in model.layers:
            h = block(h, **side)
        return h

    run = jax.jit(lambda params, h: stack.stage_fn(params, h, side))
    want = loop(h)
    np.testing.assert_allclose(run(stack.params, h), want, rtol=1e-6, atol=1e-6)
    # Two stages of two blocks each: the same, run one after the other.
    halves = [jax.tree.map(lambda t, k=k: t[2 * k : 2 * k + 2], stack.params) for k in (0, 1)]
    np.testing.assert_allclose(run(halves[1], run(halves[0], h)), want, rtol=1e-6, atol=1e-6)
    rest = stack.rest(model)
    assert "layers" not in rest.params and set(rest.params) == {"embed", "pos", "norm", "head"}
    assert rest.specs["embed"]["embedding"] == P("vocab", "embed")
    assert rest.specs["head"]["kernel"] == P()


def test_update_writes_the_params_back():
    model = make_model()
    stack = jnn.stack_blocks(model.layers)
    rest = stack.rest(model)
    stack.update(jax.tree.map(lambda t: t + 1, stack.params))
    rest.update(jax.tree.map(lambda t: t * 2, rest.params))
    fresh = make_model()
    for got, old in zip(model.layers, fresh.layers, strict=True):
        np.testing.assert_allclose(got.qkv.kernel[...], old.qkv.kernel[...] + 1)
    np.testing.assert_allclose(model.head.kernel[...], 2 * fresh.head.kernel[...])


def test_bad_blocks_are_named():
    model = make_model()
    with pytest.raises(ValueError, match=r"stack_blocks: blocks\[1\] \(Linear\) differs"):
        jnn.stack_blocks([model.layers[0].qkv, model.layers[0].out])
    with pytest.raises(ValueError, match=r"stack_blocks: blocks is empty"):
        jnn.stack_blocks([])
    with pytest.raises(TypeError, match=r"stack_blocks: blocks\[0\] must be a flax\.nnx\.Module"):
        jnn.stack_blocks([{"w": np.ones(3)}])
    with pytest.raises(ValueError, match=r"holds state that is no nnx\.Param: .*BatchStat"):
        jnn.stack_blocks([nnx.BatchNorm(4, rngs=nnx.Rngs(0)) for _ in range(2)])


# ------------------------------------------------------------------ trained in a Trainer
def one_device(batches):
    """The model's own __call__ on one device: a jitted optax SGD loop on the whole batch."""
    model = make_model()
    graph, params, other = nnx.split(model, nnx.Param, ...)
    opt = optax.sgd(LR)

    @jax.jit
    def step(params, opt_state, b):
        def loss(params):
            logits = nnx.merge(graph, params, other)(b["tokens"], b["pos"], b["seg"])
            return xent(logits, b["y"])

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, losses = opt.init(params), []
    for b in batches:
        params, opt_state, value = step(params, opt_state, b)
        losses.append(value)
    nnx.update(model, params)
    return model, [float(x) for x in losses]


def test_a_trainer_with_a_pipeline_trains_the_nnx_model_as_one_device():
    batches = [packed(16, 10 + i) for i in range(STEPS)]
    model = make_model()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "data"))
    layout = dp.Layout(replicate="data", pipeline="pipe", schedule=parallel.OneFOneB(4))

    # ---- the glue: the model file is unchanged
    stack = jnn.stack_blocks(model.layers)
    rest = stack.rest(model)
    params = {"blocks": stack.params, "rest": rest.params}
    specs = {"blocks": stack.specs, "rest": rest.specs}

    def head(rest_params, h, y):
        m = rest.module(rest_params)
        return xent(m.head(m.norm(h)), y)

    def loss_fn(params, batch, rng):
        m = rest.module(params["rest"])
        h = m.embed(batch["tokens"]) + m.pos(batch["pos"])
        side = {"positions": batch["pos"], "segment_ids": batch["seg"]}
        blocks, y = params["blocks"], batch["y"]
        loss = parallel.pipeline_loss(stack.stage_fn, head, blocks, params["rest"], h, y, side=side)
        return loss, {}

    trainer = dp.Trainer(loss_fn, optax.sgd(LR), mesh=mesh, layout=layout)
    state = trainer.init(params, jax.random.key(0), specs=specs)
    losses = []
    for b in batches:
        state, metrics = trainer.step(state, b)
        losses.append(metrics["loss"])
    trained = trainer.host_params(state)
    stack.update(trained["blocks"])
    rest.update(trained["rest"])
    # ---- end of the glue

    # The layers were split over the stages: each device of the pipeline holds 2 of the 4.
    kernel = state.params["blocks"]["qkv"]["kernel"]
    assert {s.data.shape[0] for s in kernel.addressable_shards} == {LAYERS // 2}
    want_model, want_losses = one_device(batches)
    np.testing.assert_allclose([float(x) for x in losses], want_losses, rtol=1e-5)
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    want = nnx.to_pure_dict(nnx.state(want_model, nnx.Param))
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert want_losses[-1] < want_losses[0]  # it trained
