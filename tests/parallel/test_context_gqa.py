"""Context attention with grouped-query attention (fewer key/value heads than query heads):
the output equals NumPy's attention over the whole sequence and the gradients equal
jax.grad of a plain dense attention, by ring and Ulysses at 2 and 4 ranks; the ring moves
only the key/value heads (bytes measured in the compiled program); a misspelled or mixed-up
axis is refused; jax.nn.dot_product_attention routed through the context role."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import parallel
from jaxcoll._core import roles
from tests.helpers import mesh_1d

B, S, H, D = 2, 16, 4, 4
METHODS = [parallel.Ring(), parallel.Ulysses()]
IDS = ["ring", "ulysses"]
# XLA:CPU's cheaper compile (the programs here are tiny; their compile time is the test's)
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _np_gqa(q, k, v, causal):
    """NumPy, float64: attention over the whole sequence, query head h using key/value head
    h // (H / Hkv)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[-2] // k.shape[-2]
    out = np.empty_like(q)
    for h in range(q.shape[-2]):
        s = np.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, h // g]) / np.sqrt(q.shape[-1])
        if causal:
            s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, h] = np.einsum("bqk,bkd->bqd", p / p.sum(-1, keepdims=True), v[:, :, h // g])
    return out


def _jnp_gqa(q, k, v, causal):
    """A plain dense grouped-query attention in jnp (the gradients' oracle)."""
    g = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, g, axis=-2), jnp.repeat(v, g, axis=-2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


@functools.partial(jax.jit, static_argnums=4, compiler_options=FAST)
def _dense_grads(q, k, v, w, causal):
    """The dense attention's output and jax.grad of ``sum(o * w)`` for q, k and v."""
    dense = lambda q, k, v: jnp.sum(_jnp_gqa(q, k, v, causal) * w)  # noqa: E731
    return _jnp_gqa(q, k, v, causal), jax.grad(dense, argnums=(0, 1, 2))(q, k, v)


def _inputs(hkv, heads=H, seed=0):
    rng = np.random.default_rng(seed)
    q, w = (rng.normal(size=(B, S, heads, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(B, S, hkv, D)).astype(np.float32) for _ in range(2))
    return q, k, v, w


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _split_run(method, causal, n, cases):
    """Outputs and gradients of ``sum(o * w)`` by context attention over ``n`` ranks, in the
    sequence's own order, for each ``(q, k, v, w)`` of ``cases`` (one program)."""
    mesh = mesh_1d(n, "context")

    def per_rank(cases):
        def one(q, k, v, w):
            def loss(q, k, v):
                o = parallel.context_attention(q, k, v, "context", method=method, causal=causal)
                return jnp.sum(o * w), o

            (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            return [o, *grads]

        return [one(*case) for case in cases]

    spec = P(None, "context")
    f = jax.jit(
        jax.shard_map(per_rank, mesh=mesh, in_specs=(spec,), out_specs=spec),
        compiler_options=FAST,
    )
    placed = jax.tree_util.tree_map(
        lambda a: jax.device_put(parallel.to_context_order(a, n), NamedSharding(mesh, spec)),
        cases,
    )
    return jax.tree_util.tree_map(lambda x: parallel.from_context_order(x, n), f(placed))


def _check_against_oracles(got, q, k, v, w, causal):
    """The largest relative difference of ``got`` (the output and the gradients of q, k and
    v) from NumPy's output and jax.grad of the dense attention."""
    want_o = _np_gqa(q, k, v, causal)
    dense_o, want_grads = _dense_grads(q, k, v, w, causal)
    assert _rel(dense_o, want_o) <= 1e-5  # the gradients' oracle is right
    return max(_rel(g, x) for g, x in zip(got, [want_o, *want_grads], strict=True))


@pytest.mark.parametrize("method", METHODS, ids=IDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n", [2, 4])
def test_gqa_equals_dense_attention_over_the_whole_sequence(n, causal, method):
    # H = 4 query heads; 1 (multi-query), 2 and 4 (multi-head) key/value heads
    cases = {hkv: _inputs(hkv, seed=hkv) for hkv in (1, 2, 4)}
    got = _split_run(method, causal, n, list(cases.values()))
    diffs = {
        hkv: _check_against_oracles(out, *case, causal)
        for (hkv, case), out in zip(cases.items(), got, strict=True)
    }
    assert max(diffs.values()) <= 1e-5, diffs


@pytest.mark.parametrize(("n", "heads", "hkv"), [(2, 6, 3), (4, 12, 6)])
def test_ulysses_with_kv_heads_the_ranks_do_not_divide(n, heads, hkv):
    # Each of the Hkv heads repeated to lcm(Hkv, n) heads before the all-to-all.
    case = _inputs(hkv, heads, seed=1)
    (got,) = _split_run(parallel.Ulysses(), True, n, [case])
    assert _check_against_oracles(got, *case, True) <= 1e-5


def test_unbound_it_is_dense_gqa():
    q, k, v, w = _inputs(2, seed=2)

    def loss(q, k, v):
        o = parallel.context_attention(q, k, v, "context", causal=True)
        return jnp.sum(o * w), o

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, o), grads = jax.jit(grad, compiler_options=FAST)(q, k, v)
    assert _check_against_oracles([o, *grads], q, k, v, w, True) <= 1e-5


def _collective_bytes(hlo: str, op: str) -> list[int]:
    """The bytes each ``op`` instruction of compiled HLO text returns (an array, or a tuple
    of them: XLA:CPU's all-to-all returns one per rank)."""
    sizes = {"f32": 4, "bf16": 2, "f16": 2}
    found = []
    for line in hlo.splitlines():
        result = re.search(rf"= (.*?) {op}\(", line)
        if result:
            arrays = re.findall(r"(\w+)\[([\d,]*)\]", result.group(1))
            found.append(sum(sizes[t] * math.prod(int(d) for d in s.split(",")) for t, s in arrays))
    return found


def _program_bytes(method, hkv, n, op):
    """The bytes of each ``op`` in the compiled program of context attention's output and
    gradients, with ``hkv`` key/value heads."""
    mesh = mesh_1d(n, "context")
    spec = P(None, "context")

    def per_rank(q, k, v, w):
        def loss(q, k, v):
            o = parallel.context_attention(q, k, v, "context", method=method)
            return jnp.sum(o * w), o

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    prog = jax.jit(
        jax.shard_map(per_rank, mesh=mesh, in_specs=(spec,) * 4, out_specs=((spec,) * 3, spec)),
        compiler_options=FAST,
    )
    shapes = [jax.ShapeDtypeStruct((B, S, h, D), jnp.float32) for h in (H, hkv, hkv, H)]
    return _collective_bytes(prog.lower(*shapes).compile().as_text(), op)


def test_the_ring_moves_only_the_kv_heads():
    # GQA passed as it is, against today's way to run it (K and V repeated to H heads before
    # the call): as many collective-permutes (the forward's n - 1 ring steps of K and V, the
    # backward's n of their gradients; XLA shares the backward's K and V shifts with the
    # forward's), each one block of K, V or a gradient of this rank's size with Hkv heads.
    n, hkv = 4, 2
    gqa = _program_bytes(parallel.Ring(), hkv, n, "collective-permute")
    repeated = _program_bytes(parallel.Ring(), H, n, "collective-permute")
    assert len(gqa) == len(repeated) == 2 * (n - 1) + 2 * n, (len(gqa), len(repeated))
    assert set(gqa) == {B * (S // n) * hkv * D * 4}, gqa
    assert sum(gqa) * H == sum(repeated) * hkv, (sum(gqa), sum(repeated))


def test_ulysses_sends_lcm_kv_heads():
    # q, the output and their gradients travel with H heads (4 all-to-alls); K, V and their
    # gradients with lcm(Hkv, n) (4 more)
    n, hkv = 2, 1
    gqa = _program_bytes(parallel.Ulysses(), hkv, n, "all-to-all")
    repeated = _program_bytes(parallel.Ulysses(), H, n, "all-to-all")
    assert len(gqa) == len(repeated) == 8, (gqa, repeated)
    assert sum(gqa) * 4 * H == sum(repeated) * (2 * H + 2 * math.lcm(hkv, n)), (gqa, repeated)


def _mesh_2d():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "context"))


def test_an_axis_the_mesh_lacks_is_refused_inside_shard_map():
    q, k, v, _ = _inputs(2)
    mesh = mesh_1d(4, "context")
    spec = P(None, "context")
    for call in (
        lambda q: parallel.context_attention(q, k[:, :4], v[:, :4], "ctx"),
        lambda q: parallel.context_positions(q.shape[1], "ctx")[None, :, None, None] + q,
    ):
        with pytest.raises(ValueError, match=r"axis_name='ctx' is not an axis of the mesh.*"):
            jax.shard_map(call, mesh=mesh, in_specs=spec, out_specs=spec)(q)
    # outside any shard_map an unbound axis is the dense attention, as documented
    assert _rel(parallel.context_attention(q, k, v, "ctx"), _np_gqa(q, k, v, True)) <= 1e-5


def test_a_bound_axis_the_sequence_is_not_split_over_is_refused():
    q, k, v, _ = _inputs(2)
    mesh = _mesh_2d()
    f = lambda q, k, v: parallel.context_attention(q, k, v, "data")  # noqa: E731
    seq = P(None, "context")  # the batch whole on every rank of "data"
    with pytest.raises(ValueError, match=r"q is the same on every rank of \['data'\]"):
        jax.shard_map(f, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)(q, k, v)
    # the batch split over "data" too: the types cannot tell, a layout's binding can
    both = P("data", "context")
    binding = roles.Binding({"context": "context", "batch": ("data", "context")})
    with roles.bound(binding), pytest.raises(ValueError, match=r"splits the batch's examples"):
        jax.shard_map(f, mesh=mesh, in_specs=(both,) * 3, out_specs=both)(q, k, v)


def _model(q, k, v):
    """A user's attention, written for one device."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_jax_attention_routed_through_the_context_role(method):
    q, k, v, _ = _inputs(2, seed=3)
    want = jax.jit(_model, compiler_options=FAST)(q, k, v)  # one device, jax's own attention
    mesh, n = _mesh_2d(), 2
    spec = P("data", "context")
    placed = [
        jax.device_put(parallel.to_context_order(a, n), NamedSharding(mesh, spec))
        for a in (q, k, v)
    ]
    binding = roles.Binding({"context": "context"}, context_method=method)
    original = jax.nn.dot_product_attention
    with roles.bound(binding), parallel.routed(binding):
        assert jax.nn.dot_product_attention is not original
        f = jax.shard_map(_model, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        lowered = jax.jit(f, compiler_options=FAST).lower(*placed)
    assert jax.nn.dot_product_attention is original
    # the binding's method ran: Ulysses' all-to-alls, or the ring's collective-permutes
    ops = re.findall(r"stablehlo\.(all_to_all|collective_permute)", lowered.as_text())
    assert set(ops) == {"all_to_all" if method == parallel.Ulysses() else "collective_permute"}
    got = lowered.compile()(*placed)
    assert _rel(parallel.from_context_order(got, n), want) <= 1e-5
    assert parallel.routed in roles.ON_TRACE


def test_routing_refuses_what_it_cannot_do_and_restores_jax():
    q, k, v, _ = _inputs(2)
    mesh = _mesh_2d()
    spec = P("data", "context")
    binding = roles.Binding({"context": "context"})
    original = jax.nn.dot_product_attention
    bias = jnp.zeros((B, H, S // 2, S // 2))
    with pytest.raises(ValueError, match=r"bias=<an array of shape .* only is_causal"):
        with roles.bound(binding), parallel.routed(binding):
            jax.shard_map(
                lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=bias),
                mesh=mesh,
                in_specs=(spec,) * 3,
                out_specs=spec,
            )(q, k, v)
    assert jax.nn.dot_product_attention is original  # restored after the error
    with parallel.routed(roles.Binding({"context": None})):  # no context role: nothing
        assert jax.nn.dot_product_attention is original
    # where the context role is not bound it is jax's own, every argument passed on
    mask = jnp.tril(jnp.ones((S, S), bool))
    got = parallel.dot_product_attention(q, k, v, mask=mask, scale=0.3)
    assert _rel(got, original(q, k, v, mask=mask, scale=0.3)) <= 1e-6
