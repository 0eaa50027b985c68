"""The test models themselves: they run, agree with each other, and do what their names say."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models import llama_linen, llama_nnx, reference

# The tests run a 2-layer variant to keep compiles short; test_default_config checks the
# default (4-layer) shapes abstractly.
CFG = llama_nnx.LlamaConfig(n_layers=2)
LINEN_CFG = llama_linen.LlamaConfig(n_layers=2)
LINEN = llama_linen.Llama(LINEN_CFG)

EXPECTED_NAMES = {
    "embed/embedding": ("vocab", "embed"),
    "attention/q/kernel": ("embed", "heads", "kv"),
    "attention/k/kernel": ("embed", "kv_heads", "kv"),
    "attention/v/kernel": ("embed", "kv_heads", "kv"),
    "attention/o/kernel": ("heads", "kv", "embed"),
    "mlp/gate/kernel": ("embed", "mlp"),
    "mlp/up/kernel": ("embed", "mlp"),
    "mlp/down/kernel": ("mlp", "embed"),
    "norm/scale": ("embed",),
}


@pytest.fixture(scope="module")
def model():
    with nnx.use_eager_sharding(False):
        return llama_nnx.Llama(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def nnx_fn(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, positions, segment_ids=None):
        return nnx.merge(graphdef, state)(tokens, positions, segment_ids)

    return lambda *args: run(state, *args)


linen_fn = jax.jit(functools.partial(llama_linen.apply, cfg=LINEN_CFG))


def linen_shapes():
    """``llama_linen.init``'s tree as shapes only (a real init costs seconds of compiling)."""
    return jax.eval_shape(functools.partial(llama_linen.init, cfg=LINEN_CFG), jax.random.key(0))


def to_linen(pure: dict) -> dict:
    """nnx pure dict -> linen params (flat Dense kernels for attention, layers_i names)."""
    d = CFG.d_model

    def block(p):
        att = p["attention"]
        return {
            "attention_norm": dict(p["attention_norm"]),
            "attention": {
                "q": {"kernel": att["q"]["kernel"].reshape(d, -1)},
                "k": {"kernel": att["k"]["kernel"].reshape(d, -1)},
                "v": {"kernel": att["v"]["kernel"].reshape(d, -1)},
                "o": {"kernel": att["o"]["kernel"].reshape(-1, d)},
            },
            "mlp_norm": dict(p["mlp_norm"]),
            "mlp": {k: dict(v) for k, v in p["mlp"].items()},
        }

    out = {"embed": dict(pure["embed"]), "final_norm": dict(pure["final_norm"])}
    for i in range(CFG.n_layers):
        out[f"layers_{i}"] = block(pure["layers"][i])
    return out


def pure_params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def a_batch(packed=False, seed=0, batch=8):
    return next(reference.batches(1, batch=batch, seq=16, seed=seed, packed=packed))


def test_models_run(model, nnx_fn):
    b = a_batch()
    logits = nnx_fn(b["tokens"], b["positions"])
    assert logits.shape == (8, 16, CFG.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    params = to_linen(pure_params(model))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, linen_shapes())
    logits = linen_fn(params, b["tokens"], b["positions"])
    assert logits.shape == (8, 16, CFG.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("packed", [False, True])
def test_nnx_and_linen_agree(model, nnx_fn, packed):
    b = a_batch(packed=packed)
    seg = b.get("segment_ids")
    want = nnx_fn(b["tokens"], b["positions"], seg)
    got = linen_fn(to_linen(pure_params(model)), b["tokens"], b["positions"], seg)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gqa_and_sharding_metadata(model):
    attention = model.layers[0].attention
    assert attention.q.kernel.shape == (CFG.d_model, CFG.n_heads, CFG.head_dim)
    assert attention.k.kernel.shape == (CFG.d_model, 2, CFG.head_dim)
    assert attention.v.kernel.shape == (CFG.d_model, 2, CFG.head_dim)
    assert attention.o.kernel.shape == (CFG.n_heads, CFG.head_dim, CFG.d_model)
    seen = set()
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(str(p) for p in path)
        key = next(k for k in EXPECTED_NAMES if re.sub(r"\w*norm/", "norm/", name).endswith(k))
        assert var.get_metadata()["out_sharding"] == EXPECTED_NAMES[key], name
        seen.add(key)
    assert seen == set(EXPECTED_NAMES)
    linen_params = linen_shapes()
    assert linen_params["layers_0"]["attention"]["k"]["kernel"].shape == (CFG.d_model, 16)


def test_linen_partition_rules_cover_every_param():
    params = linen_shapes()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = {}
    for path, leaf in flat:
        name = "/".join(k.key for k in path)
        spec = next(s for r, s in llama_linen.PARTITION_RULES if re.search(r, name))
        assert len(spec) <= leaf.ndim, name
        specs[name] = spec
    assert specs["layers_0/attention/k/kernel"] == jax.sharding.PartitionSpec("fsdp", "mp")
    assert specs["layers_1/attention/o/kernel"] == jax.sharding.PartitionSpec("mp", "fsdp")
    assert specs["layers_1/mlp/down/kernel"] == jax.sharding.PartitionSpec("mp", "fsdp")
    assert specs["embed/embedding"] == jax.sharding.PartitionSpec("mp", "fsdp")
    assert specs["final_norm/scale"] == jax.sharding.PartitionSpec(None)


def test_rope_depends_only_on_relative_position(nnx_fn):
    b = a_batch()
    base = nnx_fn(b["tokens"], b["positions"])
    shifted = nnx_fn(b["tokens"], b["positions"] + 7)
    np.testing.assert_allclose(shifted, base, rtol=1e-4, atol=1e-4)
    # Positions do matter: spreading them apart changes the logits.
    spread = nnx_fn(b["tokens"], b["positions"] * 3)
    assert np.abs(np.asarray(spread - base)).max() > 1e-2


def test_causal(nnx_fn):
    b = a_batch()
    tokens = b["tokens"].copy()
    tokens[:, 10:] = (tokens[:, 10:] + 5) % CFG.vocab_size
    a = nnx_fn(b["tokens"], b["positions"])
    c = nnx_fn(tokens, b["positions"])
    np.testing.assert_allclose(c[:, :10], a[:, :10], rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(c[:, 10:] - a[:, 10:])).max() > 1e-2


def test_packed_row_equals_segments_alone(nnx_fn):
    b = a_batch(packed=True)
    seg = b["segment_ids"]
    rows = [r for r in range(8) if seg[r].max() > 1]
    assert rows, "no packed row in the batch"
    logits = np.asarray(nnx_fn(b["tokens"], b["positions"], seg))
    # Each document alone at the start of its own row, the rest of the row filler: causal
    # attention (test_causal) keeps the filler out of the document's logits. Rows go 8 at a time
    # so that every call has the shape already compiled.
    docs = [(r, np.nonzero(seg[r] == s)[0]) for r in rows for s in np.unique(seg[r])]
    for start in range(0, len(docs), 8):
        chunk = docs[start : start + 8]
        tokens = np.zeros((8, 16), np.int32)
        positions = np.tile(np.arange(16, dtype=np.int32), (8, 1))
        for i, (r, idx) in enumerate(chunk):
            tokens[i, : len(idx)] = b["tokens"][r, idx]
        alone = np.asarray(nnx_fn(tokens, positions))
        for i, (r, idx) in enumerate(chunk):
            np.testing.assert_allclose(logits[r, idx], alone[i, : len(idx)], rtol=1e-5, atol=1e-5)
    # Without segment_ids the segments see each other: the mask is what made them equal.
    unmasked = np.asarray(nnx_fn(b["tokens"], b["positions"]))
    assert np.abs(unmasked[rows] - logits[rows]).max() > 1e-2


def test_batches():
    a = list(reference.batches(3, batch=4, seq=16, seed=1, packed=True))
    b = list(reference.batches(3, batch=4, seq=16, seed=1, packed=True))
    for x, y in zip(a, b):
        assert x.keys() == {"tokens", "positions", "targets", "segment_ids"}
        for k in x:
            assert x[k].dtype == np.int32 and x[k].shape == (4, 16)
            np.testing.assert_array_equal(x[k], y[k])
        seg, pos, tok, tgt = x["segment_ids"], x["positions"], x["tokens"], x["targets"]
        same = seg[:, 1:] == seg[:, :-1]
        np.testing.assert_array_equal(pos[:, 1:][same], pos[:, :-1][same] + 1)
        assert (pos[:, 1:][~same] == 0).all() and (pos[:, 0] == 0).all()
        np.testing.assert_array_equal(tgt[:, :-1][same], tok[:, 1:][same])
    plain = next(reference.batches(1, seed=1))
    assert "segment_ids" not in plain
    np.testing.assert_array_equal(plain["targets"][:, :-1], plain["tokens"][:, 1:])


def test_reference_trainer_lowers_loss_and_agrees_across_apis(model):
    before = pure_params(model)
    losses, params = reference.train_nnx(model, 20)
    assert len(losses) == 20
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses
    # The model object is left as it was.
    jax.tree.map(np.testing.assert_array_equal, pure_params(model), before)
    linen_losses, linen_params = reference.train_linen(LINEN, to_linen(before), 20)
    np.testing.assert_allclose(linen_losses, losses, rtol=1e-3, atol=1e-3)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3),
        linen_params,
        to_linen(params),
    )


def test_default_config():
    cfg = llama_nnx.LlamaConfig()
    assert (cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_kv_heads) == (64, 32, 4, 2)
    assert (cfg.head_dim, cfg.mlp_dim, cfg.n_layers) == (8, 64, 4)
    assert dataclasses.asdict(cfg) == dataclasses.asdict(llama_linen.LlamaConfig())
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: llama_nnx.Llama(cfg, rngs=nnx.Rngs(0)))
    assert len(abstract.layers) == 4
    nnx_shapes = jax.tree.map(jnp.shape, pure_params(abstract))
    linen_tree = jax.eval_shape(llama_linen.init, jax.random.key(0))
    assert sorted(linen_tree) == ["embed", "final_norm"] + [f"layers_{i}" for i in range(4)]
    assert nnx_shapes["layers"][3]["attention"]["k"]["kernel"] == (32, 2, 8)
    assert linen_tree["layers_3"]["attention"]["k"]["kernel"].shape == (32, 16)


def test_nnx_construction_needs_a_mesh_or_no_eager_sharding():
    with pytest.raises(ValueError, match="mesh"):
        llama_nnx.Llama(CFG, rngs=nnx.Rngs(0))
