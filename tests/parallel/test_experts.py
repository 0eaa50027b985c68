"""parallel.moe_mlp: a mixture of experts split over 2, 4 and 8 devices equals a NumPy oracle
of the whole batch (softmax and sigmoid routing, dropless and with a capacity), its gradients
equal the one-device run's, and the load it reports is the whole batch's; the arguments it
refuses, at trace time."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import parallel

E, D, H, K, B, S = 8, 8, 12, 2, 8, 6
_erf = np.vectorize(math.erf)


def _gelu(v):
    return 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)))


def oracle(x, router, w_in, w_out, *, score_func, normalize, factor):
    """The layer in float64 over the whole batch, token by token."""
    x, router, w_in, w_out = (np.asarray(a, np.float64) for a in (x, router, w_in, w_out))
    logits = x @ router
    if score_func == "softmax":
        z = np.exp(logits - logits.max(-1, keepdims=True))
        scores = z / z.sum(-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = np.argsort(-scores, axis=-1, kind="stable")[..., :K]  # (B, S, K)
    gate = np.take_along_axis(scores, choice, -1)
    if normalize:
        gate = gate / gate.sum(-1, keepdims=True)
    cap = math.inf if factor is None else max(1, math.ceil(factor * S * K / E))
    y = np.zeros_like(x)
    kept = np.zeros(E)
    for b in range(B):
        used = np.zeros(E)
        for j in range(K):  # every first choice of the sequence before any second one
            for s in range(S):
                e = choice[b, s, j]
                if used[e] < cap:
                    used[e] += 1
                    kept[e] += 1
                    y[b, s] += gate[b, s, j] * (_gelu(x[b, s] @ w_in[e]) @ w_out[e])
    routed = np.bincount(choice.reshape(-1), minlength=E).astype(np.float64)
    aux = E * np.sum(routed / (B * S * K) * scores.reshape(-1, E).mean(0))
    return y, routed, kept, aux


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (B, S, D))
    router = jax.random.normal(ks[1], (D, E))
    w_in = jax.random.normal(ks[2], (E, D, H)) / math.sqrt(D)
    w_out = jax.random.normal(ks[3], (E, H, D)) / math.sqrt(H)
    return x, router, w_in, w_out


ROUTINGS = {
    "softmax-dropless": dict(score_func="softmax", normalize=False, factor=None),
    "sigmoid-normalized-dropless": dict(score_func="sigmoid", normalize=True, factor=None),
    "softmax-capacity": dict(score_func="softmax", normalize=False, factor=1.0),
}


def _layer(routing, axis_name):
    def f(x, router, w_in, w_out):
        return parallel.moe_mlp(
            x, router, w_in, w_out, k=K, axis_name=axis_name, data_axis_name=axis_name,
            score_func=routing["score_func"], normalize=routing["normalize"],
            capacity_factor=routing["factor"],
        )  # fmt: skip

    return f


CASES = [  # every degree dropless; the other routings at two of them
    (2, "softmax-dropless"),
    (4, "softmax-dropless"),
    (8, "softmax-dropless"),
    (4, "sigmoid-normalized-dropless"),
    (2, "softmax-capacity"),
    (8, "softmax-capacity"),
]


@pytest.mark.parametrize("n, name", CASES)
def test_split_over_n_devices_equals_the_oracle_and_one_device(n, name):
    routing = ROUTINGS[name]
    args = _inputs()
    y_want, routed, kept, aux = oracle(*args, **routing)
    if routing["factor"] is not None:
        assert kept.sum() < routed.sum()  # the capacity drops some assignments

    mesh = jax.make_mesh((n,), ("expert",), devices=jax.devices()[:n])
    specs = (P("expert"), P(), P("expert"), P("expert"))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    out_specs = (P("expert"), P())
    layer = _layer(routing, "expert")
    split = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=out_specs))
    y, load = split(*placed)
    np.testing.assert_allclose(y, y_want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(load.routed, routed)
    np.testing.assert_array_equal(load.kept, kept)
    np.testing.assert_allclose(load.aux, aux, rtol=1e-5)

    # gradients: the loss of the whole batch, split (each device's share of it, the
    # replicated router's gradient summed over the devices) against one device
    def loss_one(x, router, w_in, w_out):
        y, load = _layer(routing, None)(x, router, w_in, w_out)
        return jnp.mean(y**2) + 0.1 * load.aux

    def grads_split(x, router, w_in, w_out):
        def loss(x, router, w_in, w_out):
            y, load = _layer(routing, "expert")(x, router, w_in, w_out)
            return jnp.sum(y**2) / (B * S * D) + 0.1 * load.aux / n

        router = jax.lax.pcast(router, "expert", to="varying")
        g = jax.grad(loss, argnums=(0, 1, 2, 3))(x, router, w_in, w_out)
        return g[0], jax.lax.psum(g[1], "expert"), g[2], g[3]

    want = jax.jit(jax.grad(loss_one, argnums=(0, 1, 2, 3)))(*args)
    got = jax.jit(jax.shard_map(grads_split, mesh=mesh, in_specs=specs, out_specs=specs))(*placed)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5)


def test_without_an_expert_axis_every_expert_is_local():
    args = _inputs(1)
    y, load = jax.jit(_layer(ROUTINGS["softmax-capacity"], None))(*args)
    y_want, routed, kept, aux = oracle(*args, **ROUTINGS["softmax-capacity"])
    np.testing.assert_allclose(y, y_want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(load.kept, kept)
    np.testing.assert_allclose(load.aux, aux, rtol=1e-5)


def test_experts_that_do_not_match_the_router_are_refused():
    x, router, w_in, w_out = _inputs()
    with pytest.raises(ValueError, match=r"w_in holds 4 experts on each of 1 devices"):
        parallel.moe_mlp(x, router, w_in[:4], w_out[:4], k=K, axis_name=None)


# Arguments moe_mlp refuses at trace time (nn.MoE refuses the same ones, by the same check:
# tests/dp/test_expert_training.py), each error naming the argument, its value and the fix.
BAD_ARGUMENTS = [
    (dict(k=10), r"k=10 experts per token, of num_experts=8 .*pass 1 <= k <= 8"),
    (dict(k=0), r"k=0 experts per token, of num_experts=8 .*pass 1 <= k <= 8"),
    (dict(score_func="relu"), r"score_func='relu' is not a score function; pass one of"),
    (dict(capacity_factor=0), r"capacity_factor=0 must be a positive number .* or None"),
    (dict(capacity_factor=-1.0), r"capacity_factor=-1.0 must be a positive number"),
    (dict(capacity_factor=float("inf")), r"capacity_factor=inf must be a positive number"),
]


@pytest.mark.parametrize("kwargs, match", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_at_trace_time(kwargs, match):
    x, router, w_in, w_out = _inputs()
    kwargs = {"k": K, **kwargs}
    with pytest.raises(ValueError, match=r"^parallel\.moe_mlp: " + match):
        jax.jit(lambda *a: parallel.moe_mlp(*a, **kwargs)).trace(x, router, w_in, w_out)


def test_a_k_that_is_not_an_int_is_refused():
    x, router, w_in, w_out = _inputs()
    with pytest.raises(TypeError, match=r"parallel\.moe_mlp: k must be an int, got 2.0"):
        parallel.moe_mlp(x, router, w_in, w_out, k=2.0)


def test_tokens_that_are_not_a_batch_of_sequences_are_refused():
    x, router, w_in, w_out = _inputs()
    with pytest.raises(ValueError, match=r"moe_mlp: x has shape \(48, 8\); pass a batch of"):
        parallel.moe_mlp(x.reshape(B * S, D), router, w_in, w_out, k=K)


def test_a_capacity_is_refused_where_the_context_axis_splits_the_sequences():
    # each device would count its part of every sequence: not the one-device capacity
    mesh = jax.make_mesh((2, 2), ("expert", "context"), devices=jax.devices()[:4])
    specs = (P(None, "context"), P(), P("expert"), P("expert"))
    layer = _layer(ROUTINGS["softmax-capacity"], "expert")
    split = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=P()))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(_inputs(), specs)]
    with pytest.raises(ValueError, match=r"moe_mlp: capacity_factor=1.0 .* context axis"):
        split.trace(*placed)


def test_on_gpus_the_tokens_travel_by_four_ragged_all_to_alls_and_one_count_exchange():
    # What a GPU runs, checked here by jax.export for cuda: the dispatch and the combine
    # forward, their mirrors backward, each one XLA ragged-all-to-all (exactly the rows
    # routed, no padding), and the sizes settled once, by one all-gather of n x n int32.
    n = 8
    mesh = jax.make_mesh((n,), ("expert",))
    specs = (P("expert"), P(), P("expert"), P("expert"))
    layer = _layer(ROUTINGS["softmax-dropless"], "expert")

    def grads(x, router, w_in, w_out):
        def loss(x, router, w_in, w_out):
            return jnp.sum(layer(x, router, w_in, w_out)[0] ** 2)

        router = jax.lax.pcast(router, "expert", to="varying")
        g = jax.grad(loss, argnums=(0, 1, 2, 3))(x, router, w_in, w_out)
        return g[0], jax.lax.psum(g[1], "expert"), g[2], g[3]

    f = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=specs, out_specs=specs))
    shapes = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
        for a, s in zip(_inputs(), specs)
    ]
    ok = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    text = jax.export.export(f, platforms=("cuda",), disabled_checks=ok)(*shapes).mlir_module()
    assert len(re.findall(r"ragged_all_to_all", text)) >= 4
    calls = re.findall(r"stablehlo\.custom_call @ragged_all_to_all", text)
    assert len(calls) == 4, len(calls)
    assert not re.findall(r"stablehlo\.all_to_all", text)
    counts = re.findall(r"stablehlo\.all_gather.*?-> tensor<(\w+)>", text)
    assert counts == [f"{n}x{n}xi32"], counts
