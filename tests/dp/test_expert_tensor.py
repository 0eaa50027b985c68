"""Expert tensor parallel: each expert's hidden units split over the tensor axis
(jaxcoll.nn.MoE's ``tensor_axis_name``), beside its experts split over the expert axis.

A small transformer (embedding, two blocks of GQA/RoPE attention and a mixture of experts
with a shared expert, its auxiliary loss in the loss) trains 20 plain-SGD steps under
``dp.Layout(shard=2, tensor=2, expert=2)`` (on 4 of the 8 devices, and with two replicas
on all 8) equal to one device; each device then holds half the expert bytes it holds with
the experts whole over the tensor axis; the tensor-parallel partial outputs are summed once,
on the tokens ``(T, d)`` (and their cotangent once in the backward); and a kernel whole over
the tensor axis, or a router that varies over it, are refused."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcoll import dp, parallel
from jaxcoll import nn as pnn
from tests.dp._models import max_rel_diff, token_batches

VOCAB, WIDTH, SEQ, BATCH, STEPS = 16, 32, 16, 8, 20
EXPERTS, HIDDEN, K = 4, 32, 2
AUX, LR = 0.01, 0.1


class Block(nn.Module):
    expert_tensor: bool = True

    @nn.compact
    def __call__(self, h):
        h = h + pnn.ParallelSelfAttention(
            num_heads=4, num_kv_heads=2, rope_theta=10_000.0, use_bias=False
        )(nn.LayerNorm()(h))
        moe = pnn.MoE(
            EXPERTS, HIDDEN, k=K, shared_hidden=16, router_init=nn.initializers.normal(0.5),
            tensor_axis_name="tensor" if self.expert_tensor else None,
        )  # fmt: skip
        return h + moe(nn.LayerNorm()(h))


class Model(nn.Module):
    expert_tensor: bool = True

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(VOCAB, WIDTH)(tokens)
        for _ in range(2):
            h = Block(self.expert_tensor)(h)
        return nn.Dense(VOCAB)(nn.LayerNorm()(h))


def _loss(expert_tensor=True):
    model = Model(expert_tensor)

    def loss(params, batch, rng=None):
        logits, sown = model.apply({"params": params}, batch["x"], mutable=["intermediates"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        metrics = parallel.moe_metrics(sown["intermediates"])
        return ce + AUX * metrics["moe_aux"], metrics

    return loss


def _params(expert_tensor=True):
    tokens = jnp.zeros((1, SEQ), jnp.int32)
    return Model(expert_tensor).init(jax.random.key(0), tokens)["params"]


@pytest.fixture(scope="module")
def reference():
    """20 plain-SGD steps on one device, and the first batch's MoE metrics."""
    params = nn.unbox(_params())
    grad = jax.jit(jax.grad(_loss(), has_aux=True))
    first = None
    for b in token_batches(STEPS, BATCH, SEQ, VOCAB):
        g, metrics = grad(params, b)
        first = metrics if first is None else first
        params = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, g)
    return jax.device_get(params), jax.device_get(first)


def _four_devices():
    """``dp.Layout(shard=2, tensor=2, expert=2)`` on 4 of the 8 devices (a layout given by
    degrees takes every device): the same roles, named on a 2 x 2 mesh."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("shard", "tensor"))
    return dp.Layout(shard="shard", tensor="tensor", expert="shard"), mesh


LAYOUTS = {
    "fsdp2xtp2xep2": _four_devices,
    "dp2xfsdp2xtp2xep2": lambda: (dp.Layout(replicate=2, shard=2, tensor=2, expert=2), None),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_experts_split_over_tensor_train_as_one_device(name, reference):
    layout, mesh = LAYOUTS[name]()
    want, first = reference
    trainer = dp.Trainer(_loss(), optax.sgd(LR), layout=layout, mesh=mesh)
    state = trainer.init(_params(), jax.random.key(0))
    w_in = state.params["Block_0"]["MoE_0"]["w_in"]
    # two experts per device, half of each one's hidden units
    assert w_in.sharding.shard_shape(w_in.shape) == (EXPERTS // 2, WIDTH, HIDDEN // 2)
    for i, b in enumerate(token_batches(STEPS, BATCH, SEQ, VOCAB)):
        state, metrics = trainer.step(state, b)
        if i == 0:  # the load over the whole batch, as one device counts it
            for key in ("moe_aux", "moe_imbalance"):
                np.testing.assert_allclose(metrics[key], first[key], rtol=1e-5)
    assert max_rel_diff(trainer.host_params(state), want) <= 1e-5


def _expert_bytes(expert_tensor):
    layout = dp.Layout(replicate=2, shard=2, tensor=2, expert=2)
    trainer = dp.Trainer(_loss(expert_tensor), optax.sgd(LR), layout=layout)
    params = trainer.init(_params(expert_tensor), jax.random.key(0)).params
    per_device = 0
    for block in ("Block_0", "Block_1"):
        for name in ("w_in", "w_out"):
            w = params[block]["MoE_0"][name]
            per_device += np.prod(w.sharding.shard_shape(w.shape)) * w.dtype.itemsize
    return per_device


def test_each_device_holds_half_the_expert_bytes():
    split, whole = _expert_bytes(True), _expert_bytes(False)
    # E/2 experts of d x hidden, twice (w_in, w_out), two layers, float32: whole over tensor
    assert whole == 2 * 2 * (EXPERTS // 2) * WIDTH * HIDDEN * 4
    assert split * 2 == whole


def _psums_over(jaxpr, axis):
    """The output shapes of every psum over ``axis`` in ``jaxpr`` and the jaxprs inside."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("psum"):
            axes = eqn.params.get("axes", ())
            if axis in (axes if isinstance(axes, tuple) else (axes,)):
                found += [tuple(v.aval.shape) for v in eqn.outvars]
        for value in eqn.params.values():
            subs = value if isinstance(value, (tuple, list)) else (value,)
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _psums_over(inner, axis)
    return found


def _split_moe(x, router, w_in, w_out):
    """``parallel.moe_mlp`` over a (expert 2, tensor 2) mesh, its kernels split both ways."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("expert", "tensor"))

    def f(x, router, w_in, w_out):
        y, load = parallel.moe_mlp(x, router, w_in, w_out, k=K, tensor_axis_name="tensor")
        return y, load.aux[None]  # each expert rank's tokens' own

    return jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(P("expert"), P(), P("expert", None, "tensor"), P("expert", "tensor", None)),
        out_specs=(P("expert"), P("expert")),
    )


def _dense_inputs():
    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (4, SEQ, WIDTH))
    router = jax.random.normal(keys[1], (WIDTH, EXPERTS))
    w_in = jax.random.normal(keys[2], (EXPERTS, WIDTH, HIDDEN)) / np.sqrt(WIDTH)
    w_out = jax.random.normal(keys[3], (EXPERTS, HIDDEN, WIDTH)) / np.sqrt(HIDDEN)
    return x, router, w_in, w_out


def test_the_partial_outputs_are_summed_once_on_the_tokens():
    x, router, w_in, w_out = _dense_inputs()
    split = _split_moe(x, router, w_in, w_out)
    y, _ = jax.jit(split)(x, router, w_in, w_out)
    want, _ = jax.jit(lambda *a: parallel.moe_mlp(*a, k=K))(x, router, w_in, w_out)
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)

    tokens = (x.shape[0] // 2 * SEQ, WIDTH)  # each expert rank's tokens, (T, d)
    forward = jax.make_jaxpr(split)(x, router, w_in, w_out).jaxpr
    assert _psums_over(forward, "tensor") == [tokens]

    def loss(*args):
        y, aux = split(*args)
        return jnp.sum(y * y) + jnp.sum(aux)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    both = jax.make_jaxpr(grad)(x, router, w_in, w_out).jaxpr
    # forward; backward: the tokens' cotangent, and the gates' ((T * k, 1): the router's)
    assert sorted(_psums_over(both, "tensor")) == sorted([tokens, tokens, (tokens[0] * K, 1)])
    got = jax.jit(grad)(x, router, w_in, w_out)

    def dense_loss(x, router, w_in, w_out):
        y, load = parallel.moe_mlp(x, router, w_in, w_out, k=K)
        halves = [parallel.moe_mlp(h, router, w_in, w_out, k=K)[1].aux for h in (x[:2], x[2:])]
        return jnp.sum(y * y) + jnp.sum(jnp.stack(halves))

    want = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2, 3)))(x, router, w_in, w_out)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_the_layer_initialised_split_holds_its_slices_of_the_whole_init():
    moe = pnn.MoE(EXPERTS, HIDDEN, k=K)
    x = jnp.ones((2, SEQ, WIDTH))
    whole = jax.jit(lambda x: nn.unbox(moe.init(jax.random.key(3), x)["params"]))(x)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    specs = {"router": P(), "w_in": P(None, None, "tensor"), "w_out": P(None, "tensor")}

    def values(tree):  # the boxes' values (nn.unbox would constrain them to the mesh)
        is_box = lambda b: isinstance(b, nn.Partitioned)  # noqa: E731
        return jax.tree_util.tree_map(lambda b: b.value if is_box(b) else b, tree, is_leaf=is_box)

    split = jax.shard_map(
        lambda x: values(moe.init(jax.random.key(3), x)["params"]),
        mesh=mesh,
        in_specs=P(),
        out_specs=specs,
        check_vma=False,  # the same init on every rank: the router is whole on each
    )
    got = jax.jit(split)(x)
    for name in specs:
        np.testing.assert_allclose(got[name], whole[name], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "case, match",
    [
        ("whole", r"w_in is the same on every device of the tensor axis 'tensor'"),
        ("varying", r"router varies over the tensor axis 'tensor'"),
    ],
)
def test_whole_kernels_or_a_router_varying_over_tensor_are_refused(case, match):
    x, router, w_in, w_out = _dense_inputs()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    kernels = (P(), P()) if case == "whole" else (P(None, None, "tensor"), P(None, "tensor"))

    def f(x, router, w_in, w_out):
        router = router if case == "whole" else router + jax.lax.axis_index("tensor")
        y, _ = parallel.moe_mlp(x, router, w_in, w_out, k=K, tensor_axis_name="tensor")
        return y

    mapped = jax.shard_map(
        f, mesh=mesh, in_specs=(P(), P(), *kernels), out_specs=P(), check_vma=True
    )
    with pytest.raises(ValueError, match=r"^parallel.moe_mlp: " + match):
        jax.eval_shape(mapped, x, router, w_in, w_out)
