"""Mixtures of experts inside pipeline stages (``pipeline_loss(..., has_aux=True)``): each
stage's load-balancing loss over each micro-batch reaches the loss with its weight, its
gradient flows back through the stage's routers, and every stage's loads come back.

A stage of two ``jaxcoll.nn.MoE`` layers (experts local, the load summed over the data axis)
on 2 data x 2 stages, by GPipe, 1F1B and ZB-H1, against one device running the same
micro-batches: micro-batch k is the global rows k::M, every replica's rows k::M (as a
``dp.Trainer``'s ``accum_steps`` cuts its micro-batches; the load, and so the auxiliary
loss, is over all of them). The GPT of examples/gpt.py runs the
same with ``--experts`` and a pipeline layout (its experts split over each stage's data
shards).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import nn as jcnn
from jaxcoll import parallel

R, S, M = 2, 2, 2  # data replicas, stages, micro-batches
B, T, D, E, LAYERS = 4, 4, 8, 4, 2  # rows per replica, tokens, width, experts, layers/stage
AUX = 0.5  # large, so the auxiliary loss's gradient is far above the tolerance
MOE = jcnn.MoE(num_experts=E, hidden=8, k=2, axis_name=None, data_axis_name="data")


def stage(blocks, h):
    """The user's stage: its layers in order (a residual MoE each), its weighted
    load-balancing loss and its layers' loads."""

    def layer(h, p):
        y, sown = MOE.apply({"params": p}, h, mutable=["intermediates"])
        return h + y, sown["intermediates"]

    h, sown = jax.lax.scan(layer, h, blocks)
    loads = jax.tree.leaves(sown, is_leaf=lambda v: isinstance(v, parallel.Load))[0]
    return h, (AUX * jnp.sum(loads.aux), loads)


def head(w, h, y):
    return jnp.mean((h @ w - y) ** 2)


def _problem():
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(1), S * LAYERS)
    probe = jnp.zeros((1, T, D))
    per = [nn.meta.unbox(MOE.init(k, probe)["params"]) for k in keys]
    blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *per)  # (S * LAYERS, ...), in order
    # A router far from uniform: the experts' loads differ from micro-batch to micro-batch.
    blocks["router"] = blocks["router"] * 50.0
    x = rng.normal(size=(R * B, T, D)).astype(np.float32)
    y = rng.normal(size=(R * B, T, 3)).astype(np.float32)
    w = (rng.normal(size=(D, 3)) / np.sqrt(D)).astype(np.float32)
    return blocks, w, x, y


def _groups(a):
    """Micro-batch k, the global rows k::M: ``(M, R * B / M, ...)``."""
    return jnp.stack([a[k::M] for k in range(M)])


@jax.jit
def _one_device(blocks, w, x, y, weight):
    """The oracle: one device, micro-batch k (every replica's k-th part) through every
    stage in turn, the stages' auxiliary losses (times ``weight``) added to its loss; the
    mean over k. Returns the loss, the gradients and the loads ``(S, M, ...)``."""

    def micro_batch(blocks, w, xk, yk):
        h, aux, loads = xk, 0.0, []
        for s in range(S):
            own = jax.tree.map(lambda v, s=s: v[s * LAYERS : (s + 1) * LAYERS], blocks)
            h, (term, load) = stage(own, h)
            aux, loads = aux + weight * term, [*loads, load]
        return head(w, h, yk) + aux, jax.tree.map(lambda *v: jnp.stack(v), *loads)

    def loss(blocks, w):
        each = lambda xy: micro_batch(blocks, w, *xy)  # noqa: E731
        losses, loads = jax.lax.map(each, (_groups(x), _groups(y)))
        return jnp.mean(losses), jax.tree.map(lambda v: v.swapaxes(0, 1), loads)

    (value, loads), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(blocks, w)
    return value, grads, loads


@functools.cache
def _want():
    return _one_device(*_problem(), 1.0)


def _pipelined(schedule, evaluate):
    blocks, w, x, y = _problem()
    mesh = Mesh(np.array(jax.devices()[: R * S]).reshape(R, S), ("data", "pipe"))

    def body(blocks, w, x, y):
        def loss(blocks, w):
            return parallel.pipeline_loss(
                stage, head, blocks, w, x, y, axis_name="pipe", schedule=schedule, has_aux=True
            )

        (value, loads), (g_blocks, g_w) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            blocks, w
        )
        # The params are the same on every replica: jax.grad summed their gradients over
        # "data" (the gradient trap); the mean is the sum over R.
        lead = lambda v: v[None]  # noqa: E731
        grads = (jax.tree.map(lambda g: g / R, g_blocks), g_w / R)
        # Not differentiated (an evaluation): the forwards alone, whatever the schedule.
        evaluated = loss(blocks, w)[0] if evaluate else value
        value, evaluated = (jax.lax.pmean(v, "data") for v in (value, evaluated))
        return value, jax.tree.map(lead, loads), grads, evaluated

    specs = jax.tree.map(lambda _: P("pipe"), blocks)
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))  # noqa: E731
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, P(), P("data"), P("data")),
            out_specs=(P(), P("data"), (specs, P()), P()),
        )
    )
    return f(jax.tree.map(lambda v: put(v, P("pipe")), blocks), w, put(x, P("data")), y)


@pytest.mark.parametrize(
    "schedule", [parallel.OneFOneB(M), parallel.ZeroBubble(M), parallel.GPipe(M)], ids=repr
)
def test_a_stage_s_moe_loss_and_loads_equal_one_device(schedule):
    want_loss, (want_blocks, want_w), want_loads = _want()
    evaluate = isinstance(schedule, parallel.OneFOneB)
    loss, loads, (g_blocks, g_w), evaluated = _pipelined(schedule, evaluate)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(evaluated, want_loss, rtol=1e-5)
    np.testing.assert_allclose(g_w, want_w, rtol=1e-5, atol=1e-6)
    for name in want_blocks:
        np.testing.assert_allclose(g_blocks[name], want_blocks[name], rtol=1e-4, atol=1e-6)
    # The router's gradient holds the auxiliary loss's: without it, it would differ.
    assert float(jnp.max(jnp.abs(want_blocks["router"]))) > 1e-3
    for r in range(R):  # every replica holds every stage's loads of every micro-batch
        for got, want in zip(jax.tree.leaves(loads), jax.tree.leaves(want_loads), strict=True):
            np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-6)


def test_the_aux_loss_changes_the_router_gradient():
    # The oracle's router gradient with and without the auxiliary loss: the test above
    # would see a schedule that dropped the term.
    _, (g, _), _ = _want()
    _, (g0, _), _ = _one_device(*_problem(), 0.0)
    assert float(jnp.max(jnp.abs(g["router"] - g0["router"]))) > 1e-3


def test_dense_mode_runs_each_micro_batch_with_its_term():
    # No stage axis bound: every stage's params at once on each micro-batch (here the
    # replica's rows whole, one "replica"), the same loss as the oracle's with R = 1.
    blocks, w, x, y = _problem()

    @jax.jit
    def run(blocks, w, x, y):
        value, loads = parallel.pipeline_loss(
            stage,
            head,
            blocks,
            w,
            x,
            y,
            axis_name="pipe",
            schedule=parallel.GPipe(M),
            has_aux=True,
        )
        want = 0.0
        for k in range(M):  # micro-batch k: rows k::M
            h, (term, _) = stage(blocks, x[k::M])
            want += (head(w, h, y[k::M]) + term) / M
        return value, loads, want

    value, loads, want = run(blocks, w, x[:B], y[:B])
    np.testing.assert_allclose(value, want, rtol=1e-6)
    assert loads.aux.shape == (1, M, S * LAYERS)


def test_a_stage_without_its_term_or_an_interleaved_schedule_is_named():
    blocks, w, x, y = _problem()
    mesh = Mesh(np.array(jax.devices()[:S]), ("pipe",))

    def run(stage_fn, schedule, blocks, spec):
        def body(blocks, x, y):
            return parallel.pipeline_loss(
                stage_fn,
                head,
                blocks,
                w,
                x,
                y,
                axis_name="pipe",
                schedule=schedule,
                has_aux=True,
            )[0]

        specs = jax.tree.map(lambda _: spec, blocks)
        f = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P())
        return jax.jit(f).lower(blocks, x, y)

    with pytest.raises(ValueError, match=r"has_aux=True, stage_fn must return \(h, \(loss_term"):
        run(lambda p, h: stage(p, h)[0], parallel.OneFOneB(M), blocks, P("pipe"))
    chunks = jax.tree.map(lambda v: v[None], blocks)  # (v=1, S * layers, ...)
    with pytest.raises(ValueError, match=r"has_aux=True runs under GPipe, OneFOneB"):
        run(stage, parallel.Interleaved(M, virtual=1), chunks, P(None, "pipe"))


def _norm_stage(ws, h, data_axis="data"):
    """A stage whose loss term is a statistic of its micro-batch over every replica (a
    BatchNorm's mean): which rows share a micro-batch shows in the loss."""

    def layer(h, w):
        mean = jnp.mean(h, axis=(0, 1))
        if data_axis is not None:
            mean = jax.lax.pmean(mean, data_axis)
        return jnp.tanh((h - mean) @ w), mean

    h, means = jax.lax.scan(layer, h, ws)
    return h, (jnp.sum(means**2), means)


@pytest.mark.parametrize("schedule", [parallel.OneFOneB(M), parallel.GPipe(M)], ids=repr)
def test_micro_batch_k_is_the_global_rows_k_mod_m(schedule):
    # 2 data x 2 stages, M = 2: the micro-batch statistic's loss term, the loss, its
    # gradients and the means per micro-batch equal one device's, whose micro-batch k is
    # the global rows k::M (rows far apart, so other groupings give other means).
    rng = np.random.default_rng(3)
    ws = (rng.normal(size=(S, D, D)) / np.sqrt(D)).astype(np.float32)
    w = (rng.normal(size=(D, 3)) / np.sqrt(D)).astype(np.float32)
    x = (rng.normal(size=(R * B, T, D)) + np.arange(R * B)[:, None, None]).astype(np.float32)
    y = rng.normal(size=(R * B, T, 3)).astype(np.float32)

    def oracle(ws, w):
        def one(k):
            h, (term, means) = _norm_stage(ws, x[k::M], data_axis=None)
            return head(w, h, y[k::M]) + term, means

        losses, means = zip(*(one(k) for k in range(M)), strict=True)
        return sum(losses) / M, jnp.stack(means, 1)  # means (S, M, D)

    (want, want_means), want_grads = jax.value_and_grad(oracle, (0, 1), has_aux=True)(ws, w)
    mesh = Mesh(np.array(jax.devices()[: R * S]).reshape(R, S), ("data", "pipe"))

    def body(ws, w, x, y):
        def loss(ws, w):
            return parallel.pipeline_loss(
                _norm_stage, head, ws, w, x, y, axis_name="pipe", schedule=schedule, has_aux=True
            )

        (value, means), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(ws, w)
        grads = jax.tree.map(lambda g: g / R, grads)  # summed over "data" by jax.grad
        return jax.lax.pmean(value, "data"), means[None], grads

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("pipe"), P(), P("data"), P("data")),
            out_specs=(P(), P("data"), (P("pipe"), P())),
        )
    )
    value, means, (g_ws, g_w) = f(ws, w, x, y)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for r in range(R):  # every replica holds every stage's means of every micro-batch
        np.testing.assert_allclose(means[r, :, :, 0], want_means, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_ws, want_grads[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_w, want_grads[1], rtol=1e-4, atol=1e-6)
