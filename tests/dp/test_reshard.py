"""Checkpoints across layouts (torch DCP's resharding): a checkpoint written under one
strategy and device count restores under any other, bit-identical, and training that goes
on from it is the run that was never stopped.

Each source layout trains two steps, saves once (module-scoped), then goes on two more
steps: that uninterrupted run is the oracle of every restore from it. Each layout's Trainer
(its compiled step) and restore template are built once and reused across cases.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcoll import dp
from tests.helpers import mesh_1d

LAYOUTS = {
    "ddp8": (lambda: dp.sync.DDP(), 8),
    "zero1_8": (lambda: dp.sync.ZeRO1(), 8),
    "fsdp4": (lambda: dp.sync.FSDP(), 4),
    "fsdp8": (lambda: dp.sync.FSDP(), 8),
    # HSDP: split over "shard" (4), replicated over "replica" (2)
    "hsdp2x4": (lambda: dp.sync.FSDP(), (2, 4)),
}
SAVED_AT, END = 2, 4


def _loss(p, batch, rng):
    h = jnp.tanh(batch["x"] @ p["w"] + p["b"])
    return jnp.mean((h @ p["v"] + jnp.mean(p["c"]) - batch["y"]) ** 2), {}


def _params():
    rng = np.random.default_rng(0)
    return {
        "w": (rng.normal(size=(8, 16)) * 0.5).astype(np.float32),  # splits over 4 and 8
        "b": np.zeros(16, np.float32),
        "v": (rng.normal(size=(16, 4)) * 0.5).astype(np.float32),
        "c": rng.normal(size=(3, 5)).astype(np.float32),  # no dimension splits: replicated
    }


def _batches():
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.normal(size=(16, 8)).astype(np.float32),
            "y": rng.normal(size=(16, 4)).astype(np.float32),
        }
        for _ in range(END)
    ]


def _trainer(sync, n):
    layout = None  # the mesh's axis "data"
    if isinstance(n, tuple):
        mesh = jax.make_mesh(n, ("replica", "shard"))
        layout = dp.Layout(replicate="replica", shard="shard")
    else:
        mesh = mesh_1d(n, "data")
    return dp.Trainer(
        _loss, optax.adam(0.05), mesh=mesh, layout=layout, sync=sync, extra=dp.ema(0.5)
    )


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def layouts():
    """name -> (trainer, restore template): one compiled step program per layout."""
    out = {}
    for name, (sync, n) in LAYOUTS.items():
        trainer = _trainer(sync(), n)
        out[name] = (trainer, trainer.init(_params(), jax.random.key(1)))
    return out


@pytest.fixture(scope="module")
def saved(layouts, tmp_path_factory):
    """name -> (directory, the state saved at SAVED_AT on the host, the uninterrupted run's
    state at END on the host), one save per source layout."""
    out = {}
    data = _batches()
    for name, (trainer, _) in layouts.items():
        state = trainer.init(_params(), jax.random.key(0))
        for b in data[:SAVED_AT]:
            state, _ = trainer.step(state, b)
        directory = tmp_path_factory.mktemp(f"from_{name}")
        ckpt = dp.Checkpointer(directory)
        ckpt.save(state)
        ckpt.close()
        at_save = _host(state)
        for b in data[SAVED_AT:]:
            state, _ = trainer.step(state, b)
        out[name] = (directory, at_save, _host(state))
    return out


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


@pytest.mark.parametrize("dst", list(LAYOUTS))
@pytest.mark.parametrize("src", list(LAYOUTS))
def test_checkpoint_restores_under_another_layout(src, dst, layouts, saved):
    directory, at_save, end = saved[src]
    trainer, template = layouts[dst]
    ckpt = dp.Checkpointer(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no hook state here: nothing may be reset or skipped
        state = ckpt.restore_latest(template)
    ckpt.close()
    assert int(state.step) == SAVED_AT
    # Every leaf (params, optimizer state, EMA, rng, step) bit-identical, placed as the
    # destination strategy places it (its own template's shardings).
    for got, want, tmpl in zip(_leaves(state), _leaves(at_save), _leaves(template), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding == tmpl.sharding, (got.sharding, tmpl.sharding)
    # Training goes on as the source's run that was never stopped did (same data and steps;
    # another layout sums in another order: float32 rounding).
    for b in _batches()[SAVED_AT:]:
        state, _ = trainer.step(state, b)
    for got, want in zip(_leaves(_host(state)), _leaves(end), strict=True):
        if src == dst:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def powersgd(tmp_path_factory):
    """A DDP run with PowerSGD (a per-rank hook state) on 8 devices, saved after a step."""
    trainer = dp.Trainer(
        _loss,
        optax.adam(0.05),
        mesh=mesh_1d(8, "data"),
        sync=dp.sync.DDP(hook=dp.hooks.PowerSGD(rank=2, start_iter=0)),
    )
    state, _ = trainer.step(trainer.init(_params(), jax.random.key(0)), _batches()[0])
    directory = tmp_path_factory.mktemp("powersgd")
    ckpt = dp.Checkpointer(directory)
    ckpt.save(state)
    ckpt.close()
    assert any(np.abs(x).max() > 0 for x in _leaves(_host(state.comm_state)))  # feedback kept
    return trainer, directory, _host(state)


def test_per_rank_hook_state_restores_on_the_same_ranks(powersgd):
    trainer, directory, saved_state = powersgd
    ckpt = dp.Checkpointer(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = ckpt.restore_latest(trainer.init(_params(), jax.random.key(1)))
    ckpt.close()
    for got, want in zip(_leaves(_host(state)), _leaves(saved_state), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "sync, n, why",
    [
        (lambda: dp.sync.DDP(hook=dp.hooks.PowerSGD(rank=2, start_iter=0)), 4, "for 8 ranks"),
        (lambda: dp.sync.FSDP(), 8, "has no hook state"),
    ],
    ids=["powersgd_on_4", "fsdp_on_8"],
)
def test_per_rank_hook_state_starts_fresh_elsewhere_with_a_warning(powersgd, sync, n, why):
    _, directory, saved_state = powersgd
    trainer = dp.Trainer(_loss, optax.adam(0.05), mesh=mesh_1d(n, "data"), sync=sync())
    template = trainer.init(_params(), jax.random.key(1))
    ckpt = dp.Checkpointer(directory)
    with pytest.warns(RuntimeWarning, match=rf"state.comm_state\) saved at step 1 .*{why}"):
        state = ckpt.restore_latest(template)
    ckpt.close()
    assert 1 not in ckpt.damaged  # a good checkpoint, not one to overwrite
    # Everything but the hook state is the checkpoint's; the hook state is the template's.
    for part in ("params", "opt_state", "model_state", "step", "rng", "extra"):
        for got, want in zip(
            _leaves(getattr(state, part)), _leaves(getattr(saved_state, part)), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=part)
    for got, want in zip(_leaves(state.comm_state), _leaves(template.comm_state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    state, _ = trainer.step(state, _batches()[1])  # and it trains on
    assert int(state.step) == 2
