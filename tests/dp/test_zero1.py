"""ZeRO-1 (``sync=dp.sync.ZeRO1()``) gives the unsharded result for any optax transformation.

The optimizer runs on the real params tree, sharded per leaf, so a global norm, masks,
multi_transform labels and lamb's trust ratio see every param. 20 steps on 8 devices against
20 steps of the same optimizer on one device: max relative param difference <= 1e-5. Each
device holds only 1/8 of the optimizer state of every split leaf.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from jaxcoll import dp
from tests.dp._models import (
    MLP,
    Twin,
    batches,
    cross_entropy,
    max_rel_diff,
    oracle,
    twin_diffs,
    twin_loss,
    twin_optimizer,
)
from tests.dp.test_export import _executed, _functions
from tests.helpers import mesh_1d, mesh_2d

K = 20
TOL = 1e-5


def _not_bias(params):
    return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)


def _labels(params):
    return jax.tree_util.tree_map(lambda p: "kernel" if p.ndim > 1 else "bias", params)


OPTIMIZERS = {
    "clip+adamw(mask)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3, mask=_not_bias)
    ),
    "sgd": lambda: optax.sgd(0.05),
    "multi_transform": lambda: optax.multi_transform(
        {"kernel": optax.adam(1e-2), "bias": optax.sgd(0.1)}, _labels
    ),
    "lamb": lambda: optax.lamb(1e-2),
}


def _loss(logits, batch):
    # 10x cross-entropy: gradients with a global norm well above 1, so the clip clips.
    loss, aux = cross_entropy(logits, batch)
    return 10.0 * loss, aux


def _single_device(model, optimizer, params, data):
    """Plain optax on one device over the whole global batches; the gradient norms too."""
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: model.loss_fn(p, {}, batch, jax.random.key(0))[0])(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    norms = []
    for batch in data:
        params, opt_state, norm = step(params, opt_state, batch)
        norms.append(float(norm))
    return params, norms


def _train(model, optimizer, params, data, algorithm="auto", **kw):
    trainer = dp.Trainer(model, optimizer, sync=dp.sync.ZeRO1(algorithm=algorithm), **kw)
    state = trainer.init(params, jax.random.key(1))
    for batch in data:
        state, _ = trainer.step(state, batch)
    return trainer, state


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_zero1_matches_the_unsharded_optimizer(name):
    model = dp.Linen(MLP(), _loss)
    data = batches("mlp", K, 32)
    params, _ = model.init(jax.random.key(0), data[0])
    want, norms = _single_device(model, OPTIMIZERS[name](), params, data)
    if name.startswith("clip"):
        assert min(norms) > 1.5, norms  # the clip is active at every step
    _, state = _train(model, OPTIMIZERS[name](), params, data, mesh=mesh_1d(8, "data"))
    diff = max_rel_diff(state.params, want)
    assert diff <= TOL, (name, diff)


def test_zero1_over_two_axes_with_hierarchical_collectives():
    model = dp.Linen(MLP(), _loss)
    data = batches("mlp", 5, 32)
    params, _ = model.init(jax.random.key(0), data[0])
    want, _ = _single_device(model, OPTIMIZERS["clip+adamw(mask)"](), params, data)
    _, state = _train(
        model,
        OPTIMIZERS["clip+adamw(mask)"](),
        params,
        data,
        mesh=mesh_2d(2, 4),
        layout=dp.Layout(shard=("node", "local")),  # split over both axes' 8 devices
        algorithm="hierarchical",
    )
    assert max_rel_diff(state.params, want) <= TOL


def test_each_device_holds_one_nth_of_the_optimizer_state():
    model = dp.Linen(MLP(), _loss)
    data = batches("mlp", 2, 32)
    params, _ = model.init(jax.random.key(0), data[0])
    _, state = _train(model, optax.adamw(1e-3), params, data, mesh=mesh_1d(8, "data"))
    adam = state.opt_state[0]
    assert jax.tree_util.tree_structure(adam.mu) == jax.tree_util.tree_structure(params)
    split = kept = 0
    for moments in (adam.mu, adam.nu):
        for p, m in zip(
            jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(moments), strict=True
        ):
            shapes = {s.data.shape for s in m.addressable_shards}
            assert len(m.addressable_shards) == 8 and m.shape == p.shape
            d = next((i for i, size in enumerate(p.shape) if size % 8 == 0), None)
            if d is None:  # Dense_2's bias (4,): nothing divides by 8, kept whole
                assert shapes == {p.shape}
                kept += 1
            else:  # split along its first dimension divisible by 8
                local = p.shape[:d] + (p.shape[d] // 8,) + p.shape[d + 1 :]
                assert shapes == {local}, (p.shape, shapes)
                split += 1
    assert split == 10 and kept == 2
    assert {s.data.shape for s in adam.count.addressable_shards} == {()}
    # the params themselves stay replicated: every device holds the whole of each leaf
    for leaf in jax.tree_util.tree_leaves(state.params):
        copies = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(c.shape == leaf.shape and np.array_equal(c, copies[0]) for c in copies)
    # the optimizer state keeps optax's own structure: an unsharded run can load it
    single = optax.adamw(1e-3).init(params)
    assert jax.tree_util.tree_structure(single) == jax.tree_util.tree_structure(state.opt_state)


def _collectives(trainer, state, batch, op) -> int:
    step, args = trainer.step_program(state, batch)
    return _executed(_functions(step.lower(*args).as_text()), "main", f"stablehlo.{op}")


def test_a_step_reduce_scatters_and_gathers_the_split_leaves_by_buckets():
    model = dp.Linen(MLP(), _loss)
    data = batches("mlp", 1, 32)
    params, _ = model.init(jax.random.key(0), data[0])
    leaves = jax.tree_util.tree_leaves(params)
    split = [x for x in leaves if any(s % 8 == 0 for s in x.shape)]
    assert len(split) == len(leaves) - 1  # all but Dense_2's bias (4,)
    counts, state = {}, None
    for mb in (None, 2500 / 2**20, 25.0):  # per leaf, 2.5 kB (several leaves each), one
        sync = dp.sync.ZeRO1(algorithm="native", bucket_mb=mb)
        trainer = dp.Trainer(model, optax.adam(1e-3), mesh=mesh_1d(8, "data"), sync=sync)
        if state is None:  # placed alike whatever the buckets
            state = trainer.init(params, jax.random.key(1))
        want = len(dp.plan_buckets(split, trainer.sync.bucket_bytes))
        got = tuple(
            _collectives(trainer, state, data[0], op) for op in ("reduce_scatter", "all_gather")
        )
        assert got == (want, want), (mb, got, want)
        counts[mb] = want
    assert counts[None] == len(split) > counts[2500 / 2**20] > counts[25.0] == 1, counts


def _hybrid_mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("replica", "shard"))


def test_hybrid_sharding_matches_one_device_with_one_quarter_of_the_state_per_device():
    data = batches("mlp", 5, 32)
    model = dp.Linen(Twin(MLP), twin_loss)
    params, _ = model.init(jax.random.key(0), data[0])
    want, _ = oracle(model, twin_optimizer(), params, {}, data, n=8)
    sync = dp.sync.ZeRO1(bucket_mb=0.001)  # ~1 kB: several buckets
    trainer = dp.Trainer(
        model,
        twin_optimizer(),
        mesh=_hybrid_mesh(),
        layout=dp.Layout(replicate="replica", shard="shard"),
        sync=sync,
    )
    prepared = trainer.sync
    assert (prepared.shard_axis_name, prepared.n_shard, prepared.replica_axes) == (
        "shard",
        4,
        ("replica",),
    )
    state = trainer.init(params, jax.random.key(1))
    for batch in data:
        state, _ = trainer.step(state, batch)
    diffs = twin_diffs(state.params, want)
    assert max(diffs.values()) <= TOL, diffs  # Adam and plain SGD: a scale error fails SGD
    adam = state.opt_state.inner_states["adam"].inner_state[0]
    mesh_devices = trainer.mesh.devices
    for p, m in zip(
        jax.tree_util.tree_leaves(params["adam"]), jax.tree_util.tree_leaves(adam.mu["adam"])
    ):
        d = next(i for i, size in enumerate(p.shape) if size % 4 == 0)
        local = p.shape[:d] + (p.shape[d] // 4,) + p.shape[d + 1 :]
        held = {s.device: np.asarray(s.data) for s in m.addressable_shards}
        assert {x.shape for x in held.values()} == {local}, (p.shape, d)
        for j in range(4):  # the two replicas of each slice hold the same values
            np.testing.assert_array_equal(held[mesh_devices[0, j]], held[mesh_devices[1, j]])
        whole = np.concatenate([held[mesh_devices[0, j]] for j in range(4)], axis=d)
        np.testing.assert_array_equal(whole, np.asarray(m))


def test_the_layout_names_the_shard_axis_and_hierarchical_is_refused_beside_it():
    # The layout says which axis the state is split over (HSDP: its shard axis, beside
    # replicas); shard_axis= is gone. The two-level algorithm runs over a tuple of axes,
    # which hybrid sharding's per-axis collectives never pass it.
    with pytest.raises(TypeError, match=r"dp\.sync\.ZeRO1: shard_axis= is gone; the layout"):
        dp.sync.ZeRO1(shard_axis="shard")
    with pytest.raises(
        ValueError,
        match=r"dp\.sync\.ZeRO1: algorithm='hierarchical' needs collectives over a tuple of "
        r"axes, but Layout\(replicate='replica', shard='shard'\) splits the state over its "
        r"shard axis 'shard' alone .* Pass algorithm='auto'",
    ):
        dp.Trainer(
            lambda w, b, r: (w.sum(), {}),
            optax.sgd(0.1),
            mesh=_hybrid_mesh(),
            layout=dp.Layout(replicate="replica", shard="shard"),
            sync=dp.sync.ZeRO1(algorithm="hierarchical"),
        )
    trainer = dp.Trainer(
        lambda w, b, r: (w.sum(), {}),
        optax.sgd(0.1),
        mesh=_hybrid_mesh(),
        layout=dp.Layout(shard="shard"),
        sync=dp.sync.ZeRO1(),
    )
    assert trainer.sync.replica_axes == () and trainer.sync.n_shard == 4
    assert trainer.sync.shard_axis_name == "shard"
    with pytest.raises(TypeError, match=r"shard_axis= is gone"):
        trainer.sync.replace(shard_axis="replica")
