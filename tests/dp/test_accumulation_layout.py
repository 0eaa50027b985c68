"""Gradient accumulation does not depend on the layout.

With ``accum_steps=A`` micro-batch ``j`` is the same global rows on every layout: rows ``j,
j + A, j + 2A, ...`` of the global batch, each device taking its own rows among them. Anything
computed over a whole micro-batch then equals one device's: a SyncBatchNorm's statistics
(trained on 8 devices, DDP and FSDP, equal to one device within 1e-5, params and running
statistics, and to plain jax on those micro-batches), and the MoE load-balancing loss
(``tests/test_gpt.py``: examples/gpt.py ``--experts 8`` with accumulation 2 in ``fsdp8``
equals ``--layout single``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcoll import dp
from tests.helpers import mesh_1d

ACCUM, STEPS, BATCH, TOL = 2, 4, 32, 1e-5


class Net(nn.Module):
    """Dense, BatchNorm with its statistics over ``axis_name`` (None: one device's), Dense."""

    axis_name: str | None = "data"

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16, use_bias=False)(x)  # no bias: BatchNorm cancels it
        x = nn.BatchNorm(axis_name=self.axis_name, momentum=0.8)(x, use_running_average=not train)
        return nn.Dense(4)(nn.relu(x))


def _loss(logits, batch):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {}


def _data():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        # Rows whose statistics differ along the batch: a grouping of rows by device (the old
        # split of each device's own rows) normalises with visibly different statistics.
        x = rng.normal(size=(BATCH, 8)).astype(np.float32) * np.linspace(0.2, 3.0, BATCH)[:, None]
        out.append({"x": x, "y": (x[:, :4].argmax(-1)).astype(np.int32)})
    return out


def _flat(tree):
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    }


def _max_rel(got, want):
    got, want = _flat(got), _flat(want)
    assert got.keys() == want.keys()
    return max(
        float(np.max(np.abs(got[k] - w)) / (np.max(np.abs(w)) + 1e-12)) for k, w in want.items()
    )


def _plain(model, params, ms, data, opt):
    """Plain jax on one device: micro-batch j is global rows j::ACCUM, the statistics
    threaded through the micro-batches in order, the gradients averaged."""
    opt_state = opt.init(params)

    @jax.jit
    def step(params, ms, opt_state, batch):
        grads = None
        for j in range(ACCUM):
            micro = jax.tree_util.tree_map(lambda a, j=j: a[j::ACCUM], batch)

            def loss(p, ms=ms, micro=micro):
                value, (_, new_ms) = model.loss_fn(p, ms, micro, jax.random.key(0))
                return value, new_ms

            g, ms = jax.grad(loss, has_aux=True)(params)
            grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
        grads = jax.tree_util.tree_map(lambda a: a / ACCUM, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), ms, opt_state

    for batch in data:
        params, ms, opt_state = step(params, ms, opt_state, batch)
    return params, ms


def _run(model, params, ms, data, opt, n, **kw):
    trainer = dp.Trainer(model, opt, mesh=mesh_1d(n, "data"), accum_steps=ACCUM, **kw)
    state = trainer.init(params, jax.random.key(1), model_state=ms)
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return trainer.host_params(state), jax.device_get(state.model_state), losses


def test_sync_batchnorm_with_accumulation_trains_the_one_device_params_and_statistics():
    data = _data()
    model = dp.Linen(Net(), _loss)
    params, ms = model.init(jax.random.key(0), data[0])
    opt = optax.sgd(0.2, momentum=0.9)
    one = _run(model, params, ms, data, opt, 1)
    diffs = {}
    for name, kw in {"dp8": {}, "fsdp8": {"layout": dp.Layout(shard="data")}}.items():
        params8, ms8, losses8 = _run(model, params, ms, data, opt, 8, **kw)
        loss_diff = float(np.max(np.abs(np.subtract(losses8, one[2]))))
        diffs[name] = (_max_rel(params8, one[0]), _max_rel(ms8, one[1]), loss_diff)
    # The micro-batches are the documented rows: plain jax on them gives the same.
    plain = _plain(dp.Linen(Net(None), _loss), params, ms, data, opt)
    diffs["one device vs plain jax"] = (_max_rel(one[0], plain[0]), _max_rel(one[1], plain[1]))
    bad = {k: d for k, d in diffs.items() if not max(d) <= TOL}
    assert not bad, f"max difference (params, batch_stats[, loss]) above {TOL}: {bad}"
