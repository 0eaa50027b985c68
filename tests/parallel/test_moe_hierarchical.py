"""parallel.moe_mlp's hierarchical dispatch and node-limited routing, on 8 devices as a
(node, local) = (2, 4) mesh: the layer equals a NumPy oracle of the whole batch (dropless and
with a capacity, with and without node-limited routing), its gradients equal the one-device
run's, and its compiled step brings each device fewer bytes from the other node than the
flat all-to-all's; node-limited routing keeps each token's experts in its best groups."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.moe_hierarchical import cross_process_bytes
from jaxcoll import parallel

E, D, H, K, B, S = 16, 8, 12, 3, 8, 6  # 2 experts per device, 1 sequence per device
AX = ("node", "local")
_erf = np.vectorize(math.erf)


def _gelu(v):
    return 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)))


def choose(scores, groups, limit, best=1):
    """Each token's K experts (NumPy): the best K in its ``limit`` groups of best group score
    (the sum of the group's ``best`` highest scores)."""
    s = scores.reshape(-1, E)
    out = []
    for row in s:
        allowed = np.ones(E, bool)
        if groups is not None:
            ranked = -np.sort(-row.reshape(groups, E // groups), axis=-1)
            best_of = ranked[:, :best].sum(-1)
            top = np.argsort(-best_of, kind="stable")[:limit]
            allowed = np.isin(np.arange(E) // (E // groups), top)
        out.append(np.argsort(-np.where(allowed, row, -np.inf), kind="stable")[:K])
    return np.array(out).reshape(*scores.shape[:-1], K)


def oracle(x, router, w_in, w_out, *, factor, groups, limit):
    """The layer in float64 over the whole batch, token by token (softmax routing)."""
    x, router, w_in, w_out = (np.asarray(a, np.float64) for a in (x, router, w_in, w_out))
    logits = x @ router
    z = np.exp(logits - logits.max(-1, keepdims=True))
    scores = z / z.sum(-1, keepdims=True)
    expert = choose(scores, groups, limit)
    gate = np.take_along_axis(scores, expert, -1)
    cap = math.inf if factor is None else max(1, math.ceil(factor * S * K / E))
    y = np.zeros_like(x)
    for b in range(B):
        used = np.zeros(E)
        for j in range(K):  # every first choice of the sequence before any second one
            for s in range(S):
                e = expert[b, s, j]
                if used[e] < cap:
                    used[e] += 1
                    y[b, s] += gate[b, s, j] * (_gelu(x[b, s] @ w_in[e]) @ w_out[e])
    return y


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(ks[0], (B, S, D)),
        jax.random.normal(ks[1], (D, E)),
        jax.random.normal(ks[2], (E, D, H)) / math.sqrt(D),
        jax.random.normal(ks[3], (E, H, D)) / math.sqrt(H),
    )


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), AX)


SPECS = (P(AX), P(), P(AX), P(AX))


def _grads(mesh, axis_name, **kw):
    """The jitted split step: the layer's output and the gradients of a loss of it."""

    def step(x, router, w_in, w_out):
        def loss(x, router, w_in, w_out):
            y, _ = parallel.moe_mlp(x, router, w_in, w_out, k=K, axis_name=axis_name, **kw)
            return jnp.sum(y**2) / (B * S * D), y

        router = jax.lax.pcast(router, AX, to="varying")
        (_, y), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            x, router, w_in, w_out
        )
        return y, g[0], jax.lax.psum(g[1], AX), g[2], g[3]

    out_specs = (P(AX), P(AX), P(), P(AX), P(AX))
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=SPECS, out_specs=out_specs))


CASES = {  # dropless without groups: the byte test compares it with the flat exchange
    "node-limited": dict(capacity_factor=None, groups=2, group_limit=1),
    "capacity-node-limited": dict(capacity_factor=1.0, groups=4, group_limit=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hierarchical_equals_the_oracle_and_one_device(name):
    kw = CASES[name]
    args = _inputs()
    mesh = _mesh()
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, SPECS)]
    y, *grads = _grads(mesh, AX, hierarchical=True, **kw)(*placed)
    want = oracle(*args, factor=kw["capacity_factor"], groups=kw["groups"], limit=kw["group_limit"])
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)

    def loss_one(x, router, w_in, w_out):
        y, _ = parallel.moe_mlp(x, router, w_in, w_out, k=K, axis_name=None, **kw)
        return jnp.sum(y**2) / (B * S * D)

    one = jax.jit(jax.grad(loss_one, argnums=(0, 1, 2, 3)))(*args)
    for g, w in zip(grads, one):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5)


def test_fewer_bytes_cross_nodes_than_the_flat_all_to_all():
    mesh = _mesh()
    args = _inputs(1)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, SPECS)]
    node = [i // 4 for i in range(8)]  # the program's device i is mesh row i // 4
    moved, outs = {}, {}
    for hier in (False, True):
        fn = _grads(mesh, AX, hierarchical=hier)
        moved[hier] = cross_process_bytes(fn.lower(*placed).compile().as_text(), node)
        outs[hier] = fn(*placed)
    for a, b in zip(outs[False], outs[True]):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-5)
    # flat: 4 all-to-alls (dispatch, combine and their transposes) of 8 chunks of T*K rows,
    # half of the chunks from the other node; the rows: D floats (+ the int32 id forward)
    rows = B // 8 * S * K
    flat_a2a = 8 * rows * ((D * 4 + 4) + 3 * D * 4) / 2
    assert moved[False]["all-to-all"] == pytest.approx(flat_a2a)
    # hierarchical: 2 chunks of T (token, node) pairs over the node axis, one from the other
    # node: the token (+ its K ids, K gates and the exchange's int32 id forward, its K gates'
    # cotangents backward)
    tokens = B // 8 * S
    hier_a2a = tokens * ((D + 2 * K + 1) * 4 + (D + K) * 4 + 2 * D * 4)
    assert moved[True]["all-to-all"] == pytest.approx(hier_a2a)
    assert sum(moved[True].values()) < sum(moved[False].values()) / 4


def test_cross_process_bytes_counts_the_other_nodes_share():
    mesh = _mesh()

    def f(x):
        a = jax.lax.all_to_all(x, AX, 0, 0, tiled=True)  # 8 chunks, 4 from the other node
        b = jax.lax.all_to_all(x, "local", 0, 0, tiled=True)  # within the node
        c = jax.lax.all_gather(x, "node", tiled=True)  # 2 parts, 1 from the other node
        return a + b + c[: x.shape[0]]

    x = jax.device_put(jnp.ones((8 * 16, 4)), NamedSharding(mesh, P(AX)))
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
    got = cross_process_bytes(fn.lower(x).compile().as_text(), [i // 4 for i in range(8)])
    assert got["all-to-all"] == 16 * 4 * 4 / 2
    assert got["all-gather"] == 2 * 16 * 4 * 4 / 2


def test_node_limited_routing_keeps_each_token_in_its_best_groups():
    from jaxcoll.parallel.moe.router import route

    logits = jax.random.normal(jax.random.key(3), (4, 32, E))
    for groups, limit in ((2, 1), (4, 2), (8, 3)):
        r = jax.jit(lambda z, g=groups, m=limit: route(z, K, groups=g, group_limit=m))(logits)
        scores = np.asarray(jax.nn.softmax(logits, -1), np.float64)
        np.testing.assert_array_equal(r.expert, choose(scores, groups, limit))
        np.testing.assert_allclose(r.gate, np.take_along_axis(scores, np.asarray(r.expert), -1))
        spans = [len(set(t)) for t in (np.asarray(r.expert) // (E // groups)).reshape(-1, K)]
        assert max(spans) <= limit
    bias = jax.random.normal(jax.random.key(4), (E,)) * 0.05  # with a bias: top-2 group sums
    r = jax.jit(lambda z: route(z, K, bias=bias, groups=4, group_limit=2))(logits)
    biased = np.asarray(jax.nn.softmax(logits, -1), np.float64) + np.asarray(bias, np.float64)
    np.testing.assert_array_equal(r.expert, choose(biased, 4, 2, best=2))
    plain = jax.jit(lambda z: route(z, K).expert)(logits)
    every = jax.jit(lambda z: route(z, K, groups=4, group_limit=4).expert)(logits)
    np.testing.assert_array_equal(every, plain)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(hierarchical=True, axis_name="node"), "pair of mesh axes"),
        (dict(groups=2), "takes both"),
        (dict(groups=3, group_limit=1), "must divide num_experts=16"),
        (dict(groups=2, group_limit=3), "1 <= group_limit <= groups=2"),
        (dict(groups=8, group_limit=1), "k=3 experts per token do not fit"),
    ],
)
def test_refuses_bad_hierarchy_and_groups(kw, match):
    mesh = _mesh()
    x, router, w_in, w_out = _inputs()
    kw = {"axis_name": AX, **kw}
    local = E // (8 if isinstance(kw["axis_name"], tuple) else 2)

    def f(x):
        return parallel.moe_mlp(x, router, w_in[:local], w_out[:local], k=K, **kw)[0]

    fn = jax.shard_map(f, mesh=mesh, in_specs=P(AX), out_specs=P(AX))
    with pytest.raises(ValueError, match=re.escape(match)):
        jax.jit(fn).lower(x)


def test_the_layer_selects_the_hierarchical_exchange():
    from jaxcoll import nn

    mesh = _mesh()
    x = _inputs(2)[0]

    def layer(hierarchical):
        return nn.MoE(
            num_experts=E, hidden=H, k=K, axis_name=AX, hierarchical=hierarchical,
            groups=2, group_limit=1,
        )  # fmt: skip

    params = jax.jit(layer(False).init)(jax.random.key(0), x)["params"]
    specs = {"router": P(), "w_in": P(AX), "w_out": P(AX)}
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    xs = jax.device_put(x, NamedSharding(mesh, P(AX)))
    outs = []
    for hier in (False, True):

        def f(p, x, hier=hier):
            return layer(hier).apply({"params": p}, x)

        fn = jax.shard_map(f, mesh=mesh, in_specs=(specs, P(AX)), out_specs=P(AX))
        outs.append(jax.jit(fn)(placed, xs))
    one = jax.jit(layer(False).apply)({"params": params}, x)  # unbound: every expert local
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(outs[1], one, atol=1e-5, rtol=1e-5)
