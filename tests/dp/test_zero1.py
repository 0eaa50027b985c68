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

from jaxcoll import dp
from tests.dp._models import MLP, batches, cross_entropy, max_rel_diff
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
        axis_name=("node", "local"),
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
