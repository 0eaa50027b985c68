"""jaxcoll.nn's tensor-parallel layers: split over ("tensor",) of 2 and 4 they equal the dense
layer (output, every param's gradient, the input's gradient), lower to the collectives their
docstrings promise, match independent references (NumPy attention, flax's attention), drop
into a transformer, and raise clear errors."""

from __future__ import annotations

import doctest
import functools
import math
import re
from collections import Counter

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen
from jax.sharding import PartitionSpec as P

from jaxcoll import nn as tp
from jaxcoll.nn import ParallelMLP, ParallelSelfAttention
from tests.helpers import mesh_1d

B, S, D, HIDDEN, HEADS = 2, 8, 16, 32, 4  # batch, sequence, width, MLP hidden width, heads
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")

LAYERS = {
    "mlp": lambda: ParallelMLP(features=D, hidden=HIDDEN, bias_init=_randn),
    "mlp-nobias": lambda: ParallelMLP(features=D, hidden=HIDDEN, use_bias=False),
    "mlp-seqpar": lambda: ParallelMLP(
        features=D, hidden=HIDDEN, sequence_parallel=True, bias_init=_randn
    ),
    "attn": lambda: ParallelSelfAttention(num_heads=HEADS, bias_init=_randn),
    "attn-nobias": lambda: ParallelSelfAttention(num_heads=HEADS, use_bias=False),
    "attn-seqpar": lambda: ParallelSelfAttention(
        num_heads=HEADS, sequence_parallel=True, bias_init=_randn
    ),
    "attn-fused": lambda: ParallelSelfAttention(num_heads=HEADS, bias_init=_randn, fused_qkv=True),
}


def _randn(key, shape, dtype=jnp.float32):  # biases that are not zero, so they are checked
    return 0.1 * jax.random.normal(key, shape, dtype)


def _init(module, x, seed):
    """``module.init`` outside shard_map (whole params), as one compiled program."""
    return jax.jit(module.init)(jax.random.key(seed), x)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, S, D)).astype(np.float32)
    target = rng.normal(size=(B, S, D)).astype(np.float32)
    return x, target


def _counts(text: str) -> dict[str, int]:
    """How many collectives of each kind a lowered program runs: the ops in each function of
    the module, times the number of times ``main`` reaches that function through calls."""
    bodies: dict[str, list[str]] = {}
    for line in text.splitlines():
        if found := re.match(r"\s*func\.func (?:public |private )?@([\w.]+)\(", line):
            current = bodies.setdefault(found.group(1), [])
        elif bodies:
            current.append(line)

    def total(name: str) -> Counter:
        lines = "\n".join(bodies[name])
        out = Counter({c: len(re.findall(rf"stablehlo\.{c}\b", lines)) for c in COLLECTIVES})
        for callee in re.findall(r"\bcall @([\w.]+)\(", lines):
            out += total(callee)
        return out

    return {c: k for c, k in total("main").items() if k}


def _close(got, want, what):
    assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want)), what
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=f"{what}{path}"
        )


# ----------------------------------------------------------- split equals dense, both ways
@functools.cache
def _dense(kind):
    """The layer's whole params (boxed), and its dense output and gradients: the reference.
    A sequence-parallel layer's is its plain twin's (the option does nothing in dense mode)."""
    if kind.endswith("-seqpar"):
        return _dense(kind.removesuffix("-seqpar"))
    layer = LAYERS[kind]()
    x, target = _data()
    boxed = _init(layer, x, 0)  # outside shard_map: whole (dense) params

    def loss(v, x):
        y = layer.apply(v, x)  # dense mode: the axis is not bound here
        return jnp.sum((y - target) ** 2), y

    (gv, gx), y = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(linen.meta.unbox(boxed), x)
    return boxed, y, gv, gx


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_split_layer_equals_dense_output_and_gradients(kind, n):
    layer = LAYERS[kind]()
    seqpar = kind.endswith("seqpar")
    x, target = _data()
    boxed, want_y, want_gv, want_gx = _dense(kind)
    assert all(
        isinstance(v, linen.Partitioned)
        for v in jax.tree.leaves(boxed, is_leaf=lambda v: isinstance(v, linen.Partitioned))
    )
    specs = linen.get_partition_spec(boxed)
    params = boxed if n == 2 else linen.meta.unbox(boxed)  # boxed at n=2, plain arrays at n=4

    tokens = P(None, "tensor") if seqpar else P()  # sequence parallel: this rank's positions

    def body(v, x, t):
        def loss(v, x):
            y = layer.apply(v, x)
            part = jnp.sum((y - t) ** 2)
            # invariant over the axis: with sequence parallelism each rank holds a part
            return (jax.lax.psum(part, "tensor") if seqpar else part), y

        (gv, gx), y = jax.grad(loss, argnums=(0, 1), has_aux=True)(v, x)
        return y, gv, gx

    mesh = mesh_1d(n, "tensor")
    split = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, tokens, tokens),
            out_specs=(tokens, specs, tokens),
        )
    )
    lowered = split.lower(params, x, target)
    y, gv, gx = lowered.compile()(params, x, target)
    _close(y, want_y, "output")
    _close(gv, want_gv, "grad ")  # out_specs=specs: the ranks' slices, gathered whole
    _close(gx, want_gx, "input grad")
    assert isinstance(
        jax.tree.leaves(gv, is_leaf=lambda v: isinstance(v, linen.Partitioned))[0],
        linen.Partitioned,
    ) == (n == 2)

    # Communication. The forward alone (lowered on 2 devices; the count does not depend on n):
    if n == 2:
        forward = jax.jit(
            jax.shard_map(layer.apply, mesh=mesh, in_specs=(specs, tokens), out_specs=tokens)
        )
        assert _counts(forward.lower(params, x).as_text()) == (
            {"all_gather": 1, "reduce_scatter": 1} if seqpar else {"all_reduce": 1}
        )
    # The forward with its backward, which adds the mirror:
    if seqpar:
        # a reduce-scatter for the all-gather, an all-gather for the reduce-scatter; and the
        # output bias's gradient, (16,), is summed by an all-reduce (the bias is replicated,
        # the rows it was added to are each rank's own)
        assert _counts(lowered.as_text()) == {
            "all_reduce": 1,
            "all_gather": 2,
            "reduce_scatter": 2,
        }
    else:
        # an all-reduce of the input's cotangent
        assert _counts(lowered.as_text()) == {"all_reduce": 2}


def test_a_fused_qkv_kernel_is_nanogpts_c_attn_and_equals_three_projections():
    # nanoGPT's c_attn as torch holds it, weight (3d, d) and bias (3d,), and c_proj: reshaped
    # into the fused layer's params, the layer equals nanoGPT's attention in NumPy, and the
    # three-kernel layer given the same columns.
    rng = np.random.default_rng(0)
    x, _ = _data()
    c_attn_w = rng.normal(size=(3 * D, D)).astype(np.float32) / np.sqrt(D)
    c_attn_b = rng.normal(size=(3 * D,)).astype(np.float32) * 0.1
    c_proj_w = rng.normal(size=(D, D)).astype(np.float32) / np.sqrt(D)
    hd = D // HEADS
    kernel = c_attn_w.T.reshape(D, 3, HEADS, hd)
    fused = {
        "qkv": {"kernel": kernel, "bias": c_attn_b.reshape(3, HEADS, hd)},
        "out": {"kernel": c_proj_w.T.reshape(HEADS, hd, D), "bias": np.zeros(D, np.float32)},
    }
    got = ParallelSelfAttention(num_heads=HEADS, fused_qkv=True).apply({"params": fused}, x)

    qkv = x @ c_attn_w.T + c_attn_b  # nanoGPT: q, k, v = c_attn(x).split(n_embd, dim=2)
    q, k, v = (t.reshape(B, S, HEADS, hd).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, -1))
    att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    att = np.where(np.tril(np.ones((S, S), bool)), att, -np.inf)
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    want = (att @ v).transpose(0, 2, 1, 3).reshape(B, S, D) @ c_proj_w.T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)

    three = {n: {"kernel": kernel[:, i], "bias": fused["qkv"]["bias"][i]} for i, n in enumerate(
        ("query", "key", "value"))}  # fmt: skip
    three["out"] = fused["out"]
    plain = ParallelSelfAttention(num_heads=HEADS).apply({"params": three}, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), rtol=1e-5, atol=1e-6)
    specs = linen.get_partition_spec(
        ParallelSelfAttention(num_heads=HEADS, fused_qkv=True).init(jax.random.key(0), x)
    )["params"]
    assert specs["qkv"]["kernel"] == P(None, None, "tensor", None)
    assert specs["qkv"]["bias"] == P(None, "tensor", None)


def test_the_output_projection_has_its_own_init():
    # GPT-2 initialises c_proj (and the MLP's second kernel) with a smaller std.
    x, _ = _data()
    zeros = linen.initializers.zeros_init()
    for layer, out in (
        (ParallelSelfAttention(num_heads=HEADS, out_kernel_init=zeros), "out"),
        (ParallelMLP(features=D, hidden=HIDDEN, out_kernel_init=zeros), "fc2"),
    ):
        params = linen.meta.unbox(layer.init(jax.random.key(0), x))["params"]
        assert not np.any(np.asarray(params[out]["kernel"]))
        inner = [k for k in params if k != out]
        assert all(np.any(np.asarray(params[k]["kernel"])) for k in inner), inner


def test_under_shard_map_without_the_tensor_axis_the_layer_is_dense():
    # a data-parallel run of the same model: the mesh has no "tensor" axis, the params are
    # whole on every device, the batch is split, and the layer communicates nothing
    boxed, want_y = _dense("attn")[:2]
    x, _ = _data()
    f = jax.jit(
        jax.shard_map(
            LAYERS["attn"]().apply,
            mesh=mesh_1d(2, "data"),
            in_specs=(P(), P("data")),
            out_specs=P("data"),
        )
    )
    lowered = f.lower(boxed, x)
    assert _counts(lowered.as_text()) == {}
    _close(lowered.compile()(boxed, x), want_y, "data-parallel ")


def test_param_names_and_partition_specs():
    x, _ = _data()
    mlp = linen.get_partition_spec(_dense("mlp")[0])["params"]
    assert mlp == {
        "fc1": {"kernel": P(None, "tensor"), "bias": P("tensor")},
        "fc2": {"kernel": P("tensor", None), "bias": P(None)},
    }
    attn = ParallelSelfAttention(num_heads=HEADS, out_features=12, axis_name="model")
    variables = jax.eval_shape(attn.init, jax.random.key(0), x)  # shapes only: no compile
    specs = linen.get_partition_spec(variables)["params"]
    shapes = jax.tree.map(jnp.shape, linen.meta.unbox(variables))["params"]
    for name in ("query", "key", "value"):
        assert specs[name] == {"kernel": P(None, "model", None), "bias": P("model", None)}
        assert shapes[name] == {"kernel": (D, HEADS, D // HEADS), "bias": (HEADS, D // HEADS)}
    assert specs["out"] == {"kernel": P("model", None, None), "bias": P(None)}
    assert shapes["out"] == {"kernel": (HEADS, D // HEADS, 12), "bias": (12,)}
    assert jax.eval_shape(attn.apply, variables, x).shape == (B, S, 12)
    # axis_name=None: the dense layer everywhere, nothing split
    dense = jax.eval_shape(ParallelMLP(D, HIDDEN, axis_name=None).init, jax.random.key(0), x)
    assert linen.get_partition_spec(dense)["params"]["fc1"]["kernel"] == P(None, None)


def test_init_under_shard_map_gives_each_rank_its_slice_of_the_same_params():
    layer = LAYERS["attn"]()
    x, _ = _data()
    whole = _dense("attn")[0]  # initialised outside shard_map from key 0
    specs = linen.get_partition_spec(whole)
    init = jax.shard_map(
        layer.init, mesh=mesh_1d(2, "tensor"), in_specs=(P(), P()), out_specs=specs
    )
    _close(jax.jit(init)(jax.random.key(0), x), whole, "init ")


# -------------------------------------------------------------------- independent oracles
def _numpy_attention(p, x, causal=True):
    """Causal multi-head self-attention in float64 NumPy from the whole params."""
    p = {k: {n: np.asarray(a, np.float64) for n, a in v.items()} for k, v in p.items()}
    x = np.asarray(x, np.float64)
    q, k, v = (
        np.einsum("bsd,dhk->bshk", x, p[n]["kernel"]) + p[n]["bias"]
        for n in ("query", "key", "value")
    )
    hd = q.shape[-1]
    logits = np.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(hd)
    if causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bhqs,bshk->bqhk", w, v)
    return np.einsum("bqhk,hko->bqo", o, p["out"]["kernel"]) + p["out"]["bias"]


def test_attention_equals_numpy_and_flax_attention():
    x, _ = _data()
    layer = LAYERS["attn"]()
    boxed = _dense("attn")[0]
    plain, specs = linen.meta.unbox(boxed), linen.get_partition_spec(boxed)
    split = jax.jit(
        jax.shard_map(layer.apply, mesh=mesh_1d(4, "tensor"), in_specs=(specs, P()), out_specs=P())
    )
    got = np.asarray(split(plain, x))
    np.testing.assert_allclose(got, _numpy_attention(plain["params"], x), rtol=1e-5, atol=1e-5)
    # flax's own layer with the same param tree: the same function
    flax_attn = linen.MultiHeadDotProductAttention(num_heads=HEADS)
    mask = linen.make_causal_mask(jnp.ones((B, S)))
    want = jax.jit(lambda v, x: flax_attn.apply(v, x, x, mask=mask))(plain, x)
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
    # causal=False: every position sees the whole sequence
    full = ParallelSelfAttention(num_heads=HEADS, causal=False)
    np.testing.assert_allclose(
        np.asarray(jax.jit(full.apply)(plain, x)),
        _numpy_attention(plain["params"], x, causal=False),
        rtol=1e-5,
        atol=1e-5,
    )


def test_mlp_is_the_dense_block_with_torchs_gelu():
    x, _ = _data()
    p = linen.meta.unbox(_dense("mlp")[0])["params"]
    xs = np.asarray(x, np.float64)
    h = xs @ np.asarray(p["fc1"]["kernel"], np.float64) + np.asarray(p["fc1"]["bias"])
    h = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))(h)  # nn.GELU()
    want = h @ np.asarray(p["fc2"]["kernel"], np.float64) + np.asarray(p["fc2"]["bias"])
    np.testing.assert_allclose(np.asarray(_dense("mlp")[1]), want, rtol=1e-5, atol=1e-5)


def test_attention_dropout_drops_the_same_weights_split_and_dense():
    x, _ = _data()
    layer = ParallelSelfAttention(num_heads=HEADS, dropout_rate=0.5)
    boxed, without_dropout = _dense("attn")[:2]  # the same param tree
    plain, specs = linen.meta.unbox(boxed), linen.get_partition_spec(boxed)
    rngs = {"dropout": jax.random.key(7)}

    def apply(v, x):
        return layer.apply(v, x, deterministic=False, rngs=rngs)

    want = jax.jit(apply)(plain, x)
    split = jax.jit(
        jax.shard_map(apply, mesh=mesh_1d(2, "tensor"), in_specs=(specs, P()), out_specs=P())
    )
    _close(split(plain, x), want, "dropout ")
    assert np.abs(np.asarray(want) - np.asarray(without_dropout)).max() > 1e-2


# ------------------------------------------------------------------- dropped into a model
class Block(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = x + ParallelSelfAttention(num_heads=HEADS, name="attn")(linen.LayerNorm()(x))
        return x + ParallelMLP(features=D, hidden=HIDDEN, name="mlp")(linen.LayerNorm()(x))


class Transformer(linen.Module):
    @linen.compact
    def __call__(self, x):
        for i in range(2):
            x = Block(name=f"block{i}")(x)
        return linen.LayerNorm()(x)


def test_a_two_block_transformer_split_over_two_devices_equals_dense():
    model = Transformer()
    x, target = _data(4)
    variables = _init(model, x, 0)
    specs = linen.get_partition_spec(variables)
    assert specs["params"]["block1"]["mlp"]["fc2"]["kernel"] == P("tensor", None)
    assert specs["params"]["block0"]["LayerNorm_0"]["scale"] == P()  # not boxed: replicated

    def loss(v, x):
        return jnp.mean((model.apply(v, x) - target) ** 2)

    want = jax.jit(jax.value_and_grad(loss))(variables, x)
    split = jax.jit(
        jax.shard_map(
            jax.value_and_grad(loss),
            mesh=mesh_1d(2, "tensor"),
            in_specs=(specs, P()),
            out_specs=(P(), specs),
        )
    )
    lowered = split.lower(variables, x)
    _close(lowered.compile()(variables, x), want, "model ")
    # 4 layers, each one all-reduce forward and one backward (the LayerNorms' gradients
    # need the latter: their outputs are replicated inputs of split layers)
    assert _counts(lowered.as_text()) == {"all_reduce": 8}


# ----------------------------------------------------------------------------- the errors
def _abstract_init(module, x):
    """``module.init``'s params as shapes: all the error checks need, and nothing compiles."""
    return jax.eval_shape(module.init, jax.random.key(0), x)


def _trace_split(layer, variables, x, n, specs=None):
    specs = linen.get_partition_spec(variables) if specs is None else specs
    f = jax.jit(
        jax.shard_map(layer.apply, mesh=mesh_1d(n, "tensor"), in_specs=(specs, P()), out_specs=P())
    )
    return f.trace(variables, x)


def test_error_when_the_split_dimension_does_not_divide():
    x, _ = _data()
    mlp = ParallelMLP(features=D, hidden=6)
    whole = linen.meta.unbox(_abstract_init(mlp, x))  # dense: any hidden
    with pytest.raises(
        ValueError,
        match=r"ParallelMLP: hidden=6 is not divisible by the 4 ranks of mesh axis 'tensor'.*"
        r"Pick a hidden width divisible by 4",
    ):
        _trace_split(mlp, whole, x, 4, specs=P())
    attn = ParallelSelfAttention(num_heads=2)
    whole = linen.meta.unbox(_abstract_init(attn, x))
    with pytest.raises(
        ValueError,
        match=r"ParallelSelfAttention: num_heads=2 is not divisible by the 4 ranks of mesh "
        r"axis 'tensor'.*Each rank owns whole heads",
    ):
        _trace_split(attn, whole, x, 4, specs=P())


def test_an_indivisible_split_is_named_by_the_layer_where_the_params_are_placed():
    # Before: the layers' own check ran only inside shard_map, after the params were placed;
    # placing them first failed with JAX's IndivisibleError (or a message about a param's
    # dimension), which names neither the layer nor its argument.
    import optax
    from jax.sharding import NamedSharding

    from jaxcoll import dp

    x, _ = _data()
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))

    class Block(linen.Module):
        hidden: int
        heads: int

        @linen.compact
        def __call__(self, x):
            x = x + ParallelSelfAttention(num_heads=self.heads, name="attn")(x)
            return x + ParallelMLP(features=D, hidden=self.hidden, name="mlp")(x)

    def trainer_init(block):
        boxed = block.init(jax.random.key(0), x)["params"]  # outside: whole params, any size
        loss = lambda p, b, rng: (jnp.mean(block.apply({"params": p}, b["x"]) ** 2), {})  # noqa: E731
        trainer = dp.Trainer(loss, optax.sgd(0.1), mesh=mesh, layout=dp.Layout(tensor="tensor"))
        return trainer.init(boxed, jax.random.key(1))

    with pytest.raises(
        ValueError,
        match=r"Trainer.init: ParallelMLP 'mlp': hidden=6 is not divisible by the 4 ranks of "
        r"mesh axis 'tensor', over which it is split\. Pick a hidden width divisible by 4, or "
        r"split over an axis whose size divides 6\. \(params\['mlp'\]\['fc1'\]",
    ):
        trainer_init(Block(hidden=6, heads=4))
    with pytest.raises(
        ValueError,
        match=r"Trainer.init: ParallelSelfAttention 'attn': num_heads=2 is not divisible by the "
        r"4 ranks of mesh axis 'tensor'.*Each rank owns whole heads",
    ):
        trainer_init(Block(hidden=8, heads=2))
    trainer_init(Block(hidden=8, heads=4))  # sizes the axis divides

    # Initialised under jax.set_mesh and placed by out_shardings from the boxes: the layer
    # raises while init is traced, before JAX's IndivisibleError at placement.
    def placed_init(module):
        specs = linen.get_partition_spec(jax.eval_shape(module.init, jax.random.key(0), x))
        shardings = jax.tree.map(
            lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
        )
        with jax.set_mesh(mesh):
            return jax.jit(module.init, out_shardings=shardings)(jax.random.key(0), x)

    with pytest.raises(ValueError, match=r"^ParallelMLP: hidden=6 is not divisible by the 4 "):
        placed_init(ParallelMLP(features=D, hidden=6))
    with pytest.raises(ValueError, match=r"^ParallelSelfAttention: num_heads=2 is not divis"):
        placed_init(ParallelSelfAttention(num_heads=2))
    kernel = placed_init(ParallelMLP(features=D, hidden=8))["params"]["fc1"]["kernel"]
    assert kernel.value.sharding.spec == P(None, "tensor")


def test_error_when_params_do_not_fit_the_input_or_the_rank():
    x, _ = _data()
    mlp = ParallelMLP(features=D, hidden=HIDDEN)
    whole = linen.meta.unbox(_abstract_init(mlp, x))
    with pytest.raises(
        ValueError,
        match=r"ParallelMLP: param fc1/kernel has shape \(16, 32\), but the whole param "
        r"\(dense mode: no tensor axis is bound\) has shape \(8, 32\).*Initialise the layer",
    ):
        jax.eval_shape(mlp.apply, whole, x[..., :8])  # features mismatch: a narrower input
    with pytest.raises(
        ValueError,
        match=r"param fc1/kernel has shape \(16, 32\), but this rank's slice over mesh axis "
        r"'tensor' \(2 ranks\) has shape \(16, 16\).*"
        r"in_specs=flax\.linen\.get_partition_spec\(variables\)",
    ):
        _trace_split(mlp, whole, x, 2, specs=P())  # whole params into shard_map
    wide = ParallelMLP(features=24, hidden=HIDDEN)
    with pytest.raises(ValueError, match=r"param fc2/kernel has shape \(32, 16\).*\(32, 24\)"):
        jax.eval_shape(
            wide.apply, whole, x
        )  # features mismatch: the params are of a narrower layer


def test_error_arguments():
    x, _ = _data()
    with pytest.raises(
        ValueError,
        match=r"ParallelSelfAttention: the input width 16 does not split into num_heads=3 "
        r"heads\. Pick a number of heads that divides 16, or pass qkv_features=",
    ):
        _abstract_init(ParallelSelfAttention(num_heads=3), x)
    with pytest.raises(ValueError, match=r"qkv_features 20 does not split into num_heads=8"):
        _abstract_init(ParallelSelfAttention(num_heads=8, qkv_features=20), x)
    with pytest.raises(ValueError, match=r"ParallelMLP: features=0 must be a positive int"):
        _abstract_init(ParallelMLP(features=0, hidden=HIDDEN), x)
    with pytest.raises(TypeError, match=r"ParallelMLP: hidden must be an int, got 32\.0"):
        _abstract_init(ParallelMLP(features=D, hidden=32.0), x)
    with pytest.raises(ValueError, match=r"dropout_rate=1\.0 must be in \[0, 1\)"):
        _abstract_init(ParallelSelfAttention(num_heads=HEADS, dropout_rate=1.0), x)
    with pytest.raises(ValueError, match=r"x has shape \(16,\); it needs a sequence dim"):
        _abstract_init(ParallelSelfAttention(num_heads=HEADS), x[0, 0])

    class Named(linen.Module):  # below the root, the error names the layer's path
        @linen.compact
        def __call__(self, x):
            return ParallelMLP(features=D, hidden=0, name="mlp")(x)

    with pytest.raises(ValueError, match=r"ParallelMLP 'mlp': hidden=0 must be a positive"):
        _abstract_init(Named(), x)


def test_the_docstring_examples_run():
    globs = {
        "jax": jax,
        "jnp": jnp,
        "flax": flax,
        "P": P,
        **{k: getattr(tp, k) for k in tp.__all__},
    }
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner()
    for obj in (ParallelMLP, ParallelSelfAttention):
        for test in finder.find(obj, globs=dict(globs)):
            runner.run(test)
    assert runner.summarize(verbose=False) == doctest.TestResults(failed=0, attempted=16)
