"""ZB-H1's lowering cuts a stage's backward in two: B (the input's gradient, the forward
recomputed) and W (the params' gradient, from what B saved, recomputing nothing). Together
they are the stage's vjp, value for value, and cost what 1F1B's backward does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcoll import parallel
from jaxcoll.parallel._zero_bubble import _Split, kept_for_w


def block(h, w):
    return h + jnp.tanh(h @ w["a"] + w["c"]) @ w["b"], None


def stage(blocks, h):  # layers stacked, a scan over them: B's and W's scans are cut from it
    return jax.lax.scan(block, h, blocks)[0]


def unrolled(blocks, h):
    return jax.lax.scan(block, h, blocks, unroll=True)[0]


def _problem():
    rng = np.random.default_rng(0)
    own = {
        "a": jnp.asarray(rng.normal(size=(3, 8, 16)) * 0.3, jnp.float32),
        "b": jnp.asarray(rng.normal(size=(3, 16, 8)) * 0.3, jnp.float32),
        "c": jnp.asarray(rng.normal(size=(3, 16)) * 0.1, jnp.float32),
    }
    h = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    return own, h, ct


def _flops(f, *args):
    cost = jax.jit(f).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_b_and_w_are_the_stage_s_vjp():
    own, h, ct = _problem()
    for fn in (stage, unrolled, lambda p, x: jnp.tanh(x @ p["a"][0]) @ p["b"][0]):
        split = _Split(fn, own, h)
        d_h, saved = jax.jit(split.run_b)(own, h, ct)
        d_own = jax.jit(split.run_w)(saved)
        want_own, want_h = jax.vjp(fn, own, h)[1](ct)
        np.testing.assert_allclose(d_h, want_h, rtol=1e-6, atol=1e-6)
        for name in own:
            np.testing.assert_allclose(d_own[name], want_own[name], rtol=1e-6, atol=1e-6)


def test_w_recomputes_nothing():
    # B and W together cost 1F1B's backward (the forward recomputed once, every gradient
    # once); W alone costs the weight-gradient matmuls, no more than a forward.
    own, h, ct = _problem()
    split = _Split(unrolled, own, h)
    saved = jax.jit(split.run_b)(own, h, ct)[1]
    b, w = _flops(split.run_b, own, h, ct), _flops(split.run_w, saved)
    both = _flops(lambda o, x, c: jax.vjp(unrolled, o, x)[1](c), own, h, ct)
    forward = _flops(unrolled, own, h)
    assert b + w <= both * 1.01, (b, w, both)
    assert w <= forward * 1.01, (w, forward)


def test_what_b_saves_is_kept_until_its_w():
    rows = parallel.ZeroBubble(8).table(4)
    # The last stage runs B of micro-batches 0..3 before the W of 0.
    assert kept_for_w(rows) == 4
    assert kept_for_w(parallel.ZeroBubble(2).table(4)) == 2
