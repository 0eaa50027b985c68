"""Llama-family blocks from jaxcoll.nn: grouped-query attention with RoPE equals a NumPy
attention; split over ("tensor",) of 2 and 4 with 1, 2 or 4 key/value heads (split, or whole
where the ranks outnumber them) it equals the dense layer, outputs and gradients; under a
context axis it takes its tokens' positions; bridged into flax nnx it trains in a dp.Trainer
equal to one device, and an nnx model's MoE brings its auxiliary loss into the loss."""

from __future__ import annotations

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from jax.sharding import PartitionSpec as P

import jaxcoll.nn._nnx as nnx_recipe
from jaxcoll import dp, parallel
from jaxcoll import nn as jcnn
from jaxcoll.nn import ParallelSelfAttention
from tests.helpers import mesh_1d

B, S, D, H = 2, 8, 16, 4  # batch, sequence, width, query heads (head width D / H = 4)
THETA = 100.0  # a small base: the rotation differs visibly between neighbouring positions
TOL = 1e-5


def _layer(kv, **kw):
    return ParallelSelfAttention(num_heads=H, num_kv_heads=kv, rope_theta=THETA, **kw)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, S, D)).astype(np.float32)
    target = rng.normal(size=(B, S, D)).astype(np.float32)
    # packed rows: the positions restart where a second document starts
    positions = np.stack([np.r_[np.arange(5), np.arange(3)], np.arange(S)]).astype(np.int32)
    return x, target, positions


# --------------------------------------------------------------------------- the oracle
def _np_attention(p, x, kv, positions):
    """Causal grouped-query attention with split-half RoPE, in float64 NumPy."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    hd = D // H

    def proj(name):
        return np.einsum("bsd,dhk->bshk", x, p[name]["kernel"]) + p[name]["bias"]

    def rope(a):
        half = hd // 2
        angle = positions[..., None] * THETA ** (-np.arange(half) / half)  # (B, S, half)
        cos, sin = np.cos(angle)[:, :, None], np.sin(angle)[:, :, None]
        a1, a2 = a[..., :half], a[..., half:]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], -1)

    q, k, v = rope(proj("query")), rope(proj("key")), proj("value")
    k, v = np.repeat(k, H // kv, axis=2), np.repeat(v, H // kv, axis=2)  # head h -> h // g
    logits = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(hd)
    logits = np.where(np.tril(np.ones((S, S), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    o = np.einsum("bhqs,bshk->bqhk", w, v)
    return np.einsum("bqhk,hko->bqo", o, p["out"]["kernel"]) + p["out"]["bias"]


@functools.cache
def _dense(kv):
    """The whole params (plain), the dense output (given the packed rows' positions, and
    without positions) and every gradient: the reference, one program."""
    x, target, positions = _data()
    layer = _layer(kv)
    shapes = linen.meta.unbox(jax.eval_shape(layer.init, jax.random.key(kv), x))
    rng = np.random.default_rng(kv)  # any whole params of the layer's shapes
    params = jax.tree.map(lambda s: 0.3 * rng.normal(size=s.shape).astype(np.float32), shapes)

    def loss(v, x):
        y = layer.apply(v, x, positions)
        return jnp.sum((y - target) ** 2), y

    def reference(v, x):
        (gv, gx), y = jax.grad(loss, argnums=(0, 1), has_aux=True)(v, x)
        return y, layer.apply(v, x), gv, gx

    y, y_default, gv, gx = jax.jit(reference)(params, x)
    return params, y, y_default, gv, gx


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_the_dense_layer_is_grouped_query_attention_with_rope(kv):
    x, _, positions = _data()
    params, given, default, _, _ = _dense(kv)
    assert params["params"]["key"]["kernel"].shape == (D, kv, D // H)
    np.testing.assert_allclose(
        given, _np_attention(params["params"], x, kv, positions), rtol=TOL, atol=TOL
    )
    # without positions: the token positions, 0..S-1
    arange = np.broadcast_to(np.arange(S), (B, S))
    np.testing.assert_allclose(
        default, _np_attention(params["params"], x, kv, arange), rtol=TOL, atol=TOL
    )


# ------------------------------------------------------------- split equals dense, both ways
SPLITS = {  # name: (tensor degree, kv heads, sequence parallel); the K/V declaration
    "n2-kv1": (2, 1, False),  # whole: 2 ranks share the one kv head (multi-query)
    "n2-kv2": (2, 2, False),  # split: one kv head per rank
    "n2-kv4": (2, 4, False),  # split: two per rank (multi-head)
    "n4-kv1": (4, 1, False),  # whole
    "n4-kv2": (4, 2, False),  # whole: ranks 0, 1 use kv head 0; ranks 2, 3 kv head 1
    "n4-kv4": (4, 4, False),  # split
    "n2-kv2-seqpar": (2, 2, True),  # positions of each rank's rows, gathered with them
}


@pytest.mark.parametrize("name", list(SPLITS))
def test_split_over_the_tensor_axis_equals_the_dense_layer(name):
    n, kv, seqpar = SPLITS[name]
    x, target, positions = _data()
    want_params, want_y, _, want_gv, want_gx = _dense(kv)
    layer = _layer(kv, sequence_parallel=seqpar)
    mesh = mesh_1d(n, "tensor")
    with jax.set_mesh(mesh):  # the degree known at init: K/V declared split or whole
        specs = linen.get_partition_spec(jax.eval_shape(layer.init, jax.random.key(kv), x))
    whole = n > kv
    assert specs["params"]["key"]["kernel"] == P(None, None if whole else "tensor", None)
    assert specs["params"]["value"]["bias"] == (P(None, None) if whole else P("tensor", None))

    tokens = P(None, "tensor") if seqpar else P()

    def body(v, x, t, pos):
        def loss(v, x):
            y = layer.apply(v, x, pos)
            part = jnp.sum((y - t) ** 2)
            return (jax.lax.psum(part, "tensor") if seqpar else part), y

        (gv, gx), y = jax.grad(loss, argnums=(0, 1), has_aux=True)(v, x)
        return y, gv, gx

    split = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, tokens, tokens, tokens),
            out_specs=(tokens, specs, tokens),
        )
    )
    y, gv, gx = split(want_params, x, target, positions)
    for what, got, want in (("y", y, want_y), ("dx", gx, want_gx), ("dparams", gv, want_gv)):
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL, err_msg=f"{what}{path}")


# ------------------------------------------------------------------------- context axis
@pytest.mark.parametrize("kv, method", [(1, parallel.Ring()), (2, parallel.Ulysses())])
def test_under_a_context_axis_the_tokens_take_their_positions_in_the_sequence(kv, method):
    # (context 2) x (tensor 2): each device holds 2 query heads of 4 and its half of the
    # sequence in the load-balanced order; no positions given: the layer finds them
    x, _, _ = _data()
    layer = _layer(kv, context=method)
    params, _, want, _, _ = _dense(kv)  # the dense layer without positions: 0..S-1
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("context", "tensor"))
    with jax.set_mesh(mesh):
        specs = linen.get_partition_spec(jax.eval_shape(layer.init, jax.random.key(kv), x))
    ordered = parallel.to_context_order(jnp.asarray(x), 2)
    split = jax.jit(
        jax.shard_map(
            lambda v, x: layer.apply(v, x),
            mesh=mesh,
            in_specs=(specs, P(None, "context")),
            out_specs=P(None, "context"),
        )
    )
    got = parallel.from_context_order(split(params, ordered), 2)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


# --------------------------------------------------------------------------------- errors
def test_combinations_that_cannot_work_are_refused():
    x, _, positions = _data()

    def init(layer, *args, mesh=None):
        if mesh is None:
            return jax.eval_shape(layer.init, jax.random.key(0), x, *args)
        with jax.set_mesh(mesh):
            return jax.eval_shape(layer.init, jax.random.key(0), x, *args)

    with pytest.raises(ValueError, match=r"num_heads=4 is not a multiple of num_kv_heads=3"):
        init(_layer(3))
    with pytest.raises(ValueError, match=r"fused_qkv=True holds q, k and v.*fused_qkv=False"):
        init(_layer(2, fused_qkv=True))
    with pytest.raises(ValueError, match=r"num_kv_heads=0 must be a positive int"):
        init(_layer(0))
    twelve = ParallelSelfAttention(num_heads=12, num_kv_heads=3, qkv_features=24)
    with pytest.raises(
        ValueError, match=r"num_kv_heads=3 key/value heads cannot follow the query heads over "
        r"the 2 ranks of mesh axis 'tensor'"
    ):  # fmt: skip
        init(twelve, mesh=mesh_1d(2, "tensor"))
    with pytest.raises(ValueError, match=r"the head width must be even, got 3"):
        init(ParallelSelfAttention(num_heads=4, qkv_features=12, rope_theta=1e4))
    with pytest.raises(ValueError, match=r"rope_theta=-1.0 must be positive"):
        init(_layer(2).clone(rope_theta=-1.0))
    with pytest.raises(TypeError, match=r"rope_theta must be a number.*got str"):
        init(_layer(2).clone(rope_theta="1e4"))
    with pytest.raises(ValueError, match=r"positions were given, but.*rope_theta=None"):
        init(ParallelSelfAttention(num_heads=H), positions)
    with pytest.raises(ValueError, match=r"positions has shape \(2, 4\), where \(\.\.\., 8\)"):
        init(_layer(2), positions[:, :4])
    with pytest.raises(TypeError, match=r"positions must be integers.*float32"):
        init(_layer(2), positions.astype(np.float32))
    with pytest.raises(TypeError, match=r"pop_moe_metrics: module must be a flax.nnx.Module"):
        jcnn.pop_moe_metrics({"intermediates": {}})


def test_more_ranks_than_kv_heads_need_the_degree_at_init():
    # initialised without a mesh, K/V are declared split; 4 ranks cannot split 2 heads
    x, _, _ = _data()
    layer = _layer(2)

    def loss(params, batch, rng):
        return jnp.mean(layer.apply({"params": params}, batch["x"]) ** 2), {}

    trainer = dp.Trainer(loss, optax.sgd(0.1), layout=dp.Layout(replicate=2, tensor=4))
    boxed = jax.jit(layer.init)(jax.random.key(0), x)["params"]
    with pytest.raises(
        ValueError,
        match=r"num_kv_heads=2 is not divisible by the 4 ranks of mesh axis 'tensor'.*"
        r"initialise the layer where its tensor degree is known, under jax.set_mesh\(mesh\)",
    ):
        trainer.init(boxed, jax.random.key(1))
    # the fix the message gives: the degree known at init, K and V declared whole
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((4,), ("tensor",))):
        boxed = jax.jit(layer.init)(jax.random.key(0), x)["params"]
    assert linen.get_partition_spec(boxed)["key"]["kernel"] == P(None, None, None)
    state = trainer.init(boxed, jax.random.key(1))  # placed: whole on each tensor rank
    kernel = state.params["key"]["kernel"]
    assert kernel.sharding.shard_shape(kernel.shape)[1] == 2  # both kv heads on every device


# ------------------------------------------------------------------------------ nnx models
VOCAB, STEPS, LR = 16, 3, 0.5


class TinyLlama(nnx.Module):
    """An embedding, two pre-norm attention blocks (GQA with 2 and with 1 key/value heads,
    RoPE), a head: as an nnx user writes it, the attention a bridged linen layer."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.norms = nnx.List([nnx.RMSNorm(D, rngs=rngs) for _ in range(2)])
        self.attns = nnx.List(
            [
                nnx.bridge.ToNNX(
                    ParallelSelfAttention(num_heads=H, num_kv_heads=kv, rope_theta=THETA),
                    rngs=rngs,
                ).lazy_init(jnp.zeros((1, S, D)))
                for kv in (2, 1)
            ]
        )
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens, positions):
        h = self.embed(tokens)
        for norm, attn in zip(self.norms, self.attns):
            h = h + attn(norm(h), positions)
        return self.head(h)


class TinyMoE(nnx.Module):
    """An embedding, a bridged MoE (8 experts, top-2), a head."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        moe = jcnn.MoE(8, 24, k=2, router_init=nnx.initializers.normal(0.5))
        self.moe = nnx.bridge.ToNNX(moe, rngs=rngs).lazy_init(jnp.zeros((1, S, D)))
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens, positions):
        h = self.embed(tokens)
        return self.head(h + self.moe(h, mutable=["intermediates"]))


def _batches():
    rng = np.random.default_rng(1)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, VOCAB, (16, S + 1)).astype(np.int32)
        positions = np.broadcast_to(np.arange(S, dtype=np.int32), (16, S)).copy()
        out.append({"x": tokens[:, :-1], "y": tokens[:, 1:], "positions": positions})
    return out


def _call(model, batch, *, train, rngs):
    logits = model(batch["x"], batch["positions"])
    return logits, jcnn.pop_moe_metrics(model)  # {} without an MoE


def _loss(outputs, batch):
    logits, moe = outputs
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return (ce + 0.1 * moe["moe_aux"], moe) if moe else (ce, {})


@functools.cache
def _built(make):
    """The model, built once (a copy for each use: the one-device run updates its own), as
    one compiled program (flax's way to build a model fast, ``nnx.jit`` of its constructor)."""
    with dp.building():  # variables with sharding metadata, whole, no mesh
        return nnx.jit(lambda: make(nnx.Rngs(0)))()


def _one_device(make):
    """STEPS of plain SGD on one device, as an nnx user trains: nnx.jit, nnx.value_and_grad
    and nnx.Optimizer."""
    model = nnx.clone(_built(make))
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        def loss(model):
            return _loss(_call(model, batch, train=True, rngs=None), batch)

        (value, aux), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        optimizer.update(model, grads)
        return value, aux

    losses, metrics = [], []
    for b in _batches():
        value, aux = step(model, optimizer, b)
        losses.append(value)
        metrics.append(aux)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param)), losses, metrics


@pytest.mark.parametrize(
    "make, layout, split",
    [
        (TinyLlama, dp.Layout(shard=4, tensor=2), ("attns", 0, "key", "kernel")),
        (TinyMoE, dp.Layout(shard=8, expert=8), ("moe", "w_in")),
    ],
    ids=["attention-fsdp4-tp2", "moe-fsdp8-ep8"],
)
def test_an_nnx_model_with_a_bridged_layer_trains_as_one_device(make, layout, split):
    model = dp.Nnx(_built(make), _loss, call=_call)  # it never modifies the module
    specs = model.specs()  # the layer's splits, kept by the bridge as out_sharding
    # the experts' hidden dimension names the tensor role (split where a layout binds it)
    want_spec = P(None, "tensor", None) if make is TinyLlama else P("expert", None, "tensor")
    assert functools.reduce(lambda t, k: t[k], split, specs) == want_spec
    if make is TinyLlama:  # 2 tensor ranks share the 1 kv head: K and V whole
        assert specs["attns"][1]["key"]["kernel"] == P(None, None, None)
    trainer = dp.Trainer(model, optax.sgd(LR), layout=layout)
    params, model_state = model.init()
    state = trainer.init(params, jax.random.key(0), model_state=model_state)
    leaf = functools.reduce(lambda t, k: t[k], split, state.params)
    assert leaf.sharding.shard_shape(leaf.shape) != leaf.shape  # split over the devices
    want, want_losses, want_metrics = _one_device(make)
    for b, want_loss, want_aux in zip(_batches(), want_losses, want_metrics):
        state, metrics = trainer.step(state, b)
        np.testing.assert_allclose(metrics["loss"], want_loss, rtol=TOL)
        for key, value in want_aux.items():  # the MoE's load over the whole batch
            np.testing.assert_allclose(metrics[key], value, rtol=TOL, err_msg=key)
    if make is TinyMoE:
        assert float(want_metrics[0]["moe_aux"]) > 0.5  # the aux loss is in the loss
    got = trainer.host_params(state)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL, err_msg=jax.tree_util.keystr(path))


def test_a_bridged_moe_called_without_mutable_is_refused_not_silently_dropped():
    batch = _batches()[0]

    def forgot(model):  # TinyMoE's forward, the MoE called without mutable: nothing sown
        h = model.embed(batch["x"])
        model.head(h + model.moe(h))
        return jcnn.pop_moe_metrics(model)

    with pytest.raises(ValueError, match=r"bridged MoE 'moe' but no load.*mutable="):
        nnx.eval_shape(forgot, nnx.clone(_built(TinyMoE)))  # traced: raised at trace time
    assert jcnn.pop_moe_metrics(_built(TinyLlama)) == {}  # a model without an MoE


def test_the_recipe_examples_run():
    import jaxcoll.nn.attention as attention

    globs = {"jax": jax, "jnp": jnp, "nnx": nnx, "dp": dp, "P": P, "flax": __import__("flax")}
    globs.update({k: getattr(jcnn, k) for k in jcnn.__all__})
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner()
    for module in (nnx_recipe, attention):
        for test in finder.find(module, globs=dict(globs)):
            runner.run(test)
    assert runner.summarize(verbose=False) == doctest.TestResults(failed=0, attempted=13)
