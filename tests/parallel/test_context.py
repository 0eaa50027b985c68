"""Context parallelism: attention over a sequence split across the devices equals NumPy's
attention over the whole sequence (the output and the gradients of q, k and v), causal and
not, by ring attention and by Ulysses, at 2, 4 and 8 devices; the ring's load is balanced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import parallel
from tests.helpers import mesh_1d

B, S, H, D = 2, 32, 8, 4


def _np_attention(q, k, v, w, causal):
    """NumPy, float64: the output of attention over the whole sequence and the gradients
    of ``sum(output * w)`` with respect to q, k and v."""
    q, k, v, w = (np.asarray(a, np.float64) for a in (q, k, v, w))
    scale = 1 / np.sqrt(q.shape[-1])
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    dp = np.einsum("bqhd,bkhd->bhqk", w, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, w)
    return o, (dq, dk, dv)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(B, S, H, D)).astype(np.float32) for _ in range(4)]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("method", [parallel.Ring(), parallel.Ulysses()], ids=["ring", "ulysses"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_split_attention_equals_numpy_over_the_whole_sequence(n, causal, method):
    q, k, v, w = _inputs()
    mesh = mesh_1d(n, "context")

    def per_rank(q, k, v, w):
        def loss(q, k, v):
            o = parallel.context_attention(q, k, v, "context", method=method, causal=causal)
            return jnp.sum(o * w), o

        (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return o, grads

    spec = P(None, "context")
    f = jax.jit(
        jax.shard_map(per_rank, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, (spec,) * 3))
    )
    placed = [
        jax.device_put(parallel.to_context_order(a, n), NamedSharding(mesh, spec))
        for a in (q, k, v, w)
    ]
    o, grads = f(*placed)
    want_o, want_grads = _np_attention(q, k, v, w, causal)
    got = [parallel.from_context_order(x, n) for x in (o, *grads)]
    diffs = [_rel(g, w_) for g, w_ in zip(got, [want_o, *want_grads], strict=True)]
    assert max(diffs) <= 1e-5, diffs


def test_unbound_it_is_dense_attention():
    q, k, v, w = _inputs(1)
    o = parallel.context_attention(q, k, v, "context", causal=True)
    assert _rel(o, _np_attention(q, k, v, w, True)[0]) <= 1e-5


def test_the_order_and_the_positions_agree():
    n = 4
    order = parallel.context_order(S, n)
    c = S // (2 * n)
    assert list(order[:c]) == list(range(c))  # rank 0: chunk 0 ...
    assert list(order[c : 2 * c]) == list(range((2 * n - 1) * c, 2 * n * c))  # ... and the last
    assert sorted(order) == list(range(S))
    x = np.arange(S)[None]
    assert np.array_equal(parallel.from_context_order(parallel.to_context_order(x, n), n), x)
    assert np.array_equal(  # the sequence along another dim
        parallel.to_context_order(x.T, n, dim=0), parallel.to_context_order(x, n).T
    )
    mesh = mesh_1d(n, "context")
    pos = jax.jit(
        jax.shard_map(
            lambda: parallel.context_positions(S // n, "context")[None],
            mesh=mesh,
            in_specs=(),
            out_specs=P("context"),
        )
    )()
    assert np.array_equal(np.asarray(pos).reshape(-1), order)
    # context_part: this rank's part of an array whole on every rank
    x = np.arange(2 * S).reshape(2, S)
    parts = jax.jit(
        jax.shard_map(
            lambda x: parallel.context_part(x, "context"),
            mesh=mesh,
            in_specs=P(),
            out_specs=P(None, "context"),
        )
    )(x)
    assert np.array_equal(np.asarray(parts), np.asarray(parallel.to_context_order(x, n)))
    parts = jax.jit(
        jax.shard_map(
            lambda x: parallel.context_part(x, dim=0),  # the role "context", the sequence first
            mesh=mesh,
            in_specs=P(),
            out_specs=P("context"),
        )
    )(x.T)
    assert np.array_equal(np.asarray(parts), np.asarray(parallel.to_context_order(x.T, n, dim=0)))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_ring_balances_the_causal_load(n):
    # The blocks each rank's ring computes, counted by the program that computes them: under
    # the causal mask every rank computes 2n + 2 blocks of (S/2n)^2 (a contiguous split would
    # give rank r (r+1) blocks of (S/n)^2: the last 2n/(n+1) times the mean).
    mesh = mesh_1d(n, "context")
    shape = (B, S // n, H, D)
    blocks = jax.jit(
        jax.shard_map(
            lambda: parallel.ring_blocks(shape, "context", causal=True)[None],
            mesh=mesh,
            in_specs=(),
            out_specs=P("context"),
        )
    )()
    blocks = np.asarray(blocks)
    assert blocks.max() <= 1.1 * blocks.mean() and blocks.max() == 2 * n + 2, blocks


def test_bad_input_is_named():
    q = jnp.zeros((B, 6, 3, D))
    mesh = mesh_1d(2, "context")
    with pytest.raises(ValueError, match=r"Ulysses splits the 3 heads over the 2 ranks"):
        jax.shard_map(
            lambda q: parallel.context_attention(q, q, q, method=parallel.Ulysses()),
            mesh=mesh,
            in_specs=P(None, "context"),
            out_specs=P(None, "context"),
        )(jnp.zeros((B, 12, 3, D)))
    with pytest.raises(TypeError, match=r"method must be parallel\.Ring\(\) or"):
        parallel.context_attention(q, q, q, method="ring")
    with pytest.raises(ValueError, match=r"does not split into 8 equal chunks"):
        parallel.context_order(12, 4)
