"""FSDP on models that scan over stacked layers (``lax.scan``, flax ``nn.scan``, ``nnx.scan``):
one layer gathered per iteration, equal to one device, and the step's peak memory it buys.

Equivalence: twin Adam + plain SGD against a single-device optax run (tests/dp/_models.py);
the scans are reached directly, through ``jax.jit`` and through ``jax.checkpoint`` inside the
loss. Memory: ``memory_analysis()`` of the compiled step (argument + temp bytes per device),
against the ideal (params + Adam state) / n plus a few layers' worth, and against ZeRO-1.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

from jaxcoll import dp
from tests.dp._models import (
    MLP,
    TWIN,
    Twin,
    batches,
    oracle,
    twin_diffs,
    twin_loss,
    twin_optimizer,
)
from tests.helpers import mesh_1d

N, D, L = 8, 16, 8
TOL = 1e-5
OPT = twin_optimizer()


# -------------------------------------------------------------------------------- models
def _stack(key, width):
    """One copy's params: input projection, L stacked layers, output projection. The
    stacked "g" (L, 3) has no dimension after the layer axis that 8 divides: FSDP splits it
    along the layer axis and gathers it whole before the scan."""
    k = jax.random.split(key, 4)
    return {
        "inp": jax.random.normal(k[0], (D, width)) * 0.3,
        "layers": {
            "w": jax.random.normal(k[1], (L, width, width)) * (0.5 / np.sqrt(width)),
            "b": jax.random.normal(k[2], (L, width)) * 0.1,
            "g": jnp.full((L, 3), 0.1, jnp.float32),
        },
        "out": jax.random.normal(k[3], (width, 4)) * 0.3,
    }


def _layer(h, layer):
    return jnp.tanh(h @ layer["w"] + layer["b"]) * (1.0 + layer["g"].sum()), None


def _forward(p, x):
    h, _ = lax.scan(_layer, x @ p["inp"], p["layers"])
    return h @ p["out"]


WRAPS = {
    "adam": jax.jit(_forward),  # the scan inside a jit
    "sgd": jax.checkpoint(_forward),  # the scan inside a checkpoint
}


def scan_loss(params, batch, rng):
    return twin_loss({k: WRAPS[k](params[k], batch["x"]) for k in TWIN}, batch)


class _Plain:
    """A plain loss_fn as the oracle calls models: loss_fn(params, ms, batch, rng)."""

    def loss_fn(self, p, ms, batch, rng):
        value, metrics = scan_loss(p, batch, rng)
        return value, (metrics, ms)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(D)(h)), None


class LinenScanned(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        layers = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=L,
        )
        h, _ = layers()(nn.Dense(D)(x), None)
        return nn.Dense(4)(h)


class LinenTwin(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return {k: LinenScanned(name=k)(x) for k in TWIN}


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.lin(h))


class NnxScanned(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(16, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return NnxBlock(rngs)

        self.blocks = blocks(rngs)
        self.out = nnx.Linear(D, 4, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def through(h, block):
            return block(h)

        return self.out(through(self.inp(x), self.blocks))


class NnxTwin(nnx.Module):
    def __init__(self, rngs):
        self.adam = NnxScanned(rngs)
        self.sgd = NnxScanned(rngs)

    def __call__(self, x):
        return {k: getattr(self, k)(x) for k in TWIN}


def _model(kind):
    """(model for the Trainer, model for the oracle, params)."""
    if kind == "lax.scan":
        keys = jax.random.split(jax.random.key(0), 2)
        return scan_loss, _Plain(), {k: _stack(keys[i], D) for i, k in enumerate(TWIN)}
    if kind == "nn.scan":
        model = dp.Linen(LinenTwin(), twin_loss)
        params, _ = model.init(jax.random.key(0), batches("mlp", 1, 8)[0])
        return model, model, params
    model = dp.Nnx(NnxTwin(nnx.Rngs(0)), twin_loss)
    params, _ = model.init()
    return model, model, params


# --------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("kind", ["lax.scan", "nn.scan", "nnx.scan"])
def test_fsdp_on_a_scanned_model_equals_one_device(kind):
    model, single, params = _model(kind)
    data = batches("mlp", 4, 32)
    trainer = dp.Trainer(model, OPT, mesh=mesh_1d(N, "data"), sync=dp.sync.FSDP())
    stacked = [
        (jax.tree_util.keystr(path), d)
        for (path, leaf), d in zip(
            jax.tree_util.tree_flatten_with_path(params)[0],
            trainer.sync.shard_dims(params),
            strict=True,
        )
        if np.ndim(leaf) == 3
    ]
    # Each stacked kernel is split along a dimension of its layers, not the layer axis.
    assert stacked and all(d in (1, 2) for _, d in stacked), stacked
    state = trainer.init(params, jax.random.key(1))
    for b in data:
        state, _ = trainer.step(state, b)
    want, _ = oracle(single, OPT, params, {}, data, n=N)
    diffs = twin_diffs(jax.device_get(state.params), want)
    assert max(diffs.values()) <= TOL, diffs


# -------------------------------------------------------------------------------- memory
def _peak(trainer, params, batch) -> int:
    state = trainer.init(params, jax.random.key(1))
    step, args = trainer.step_program(state, batch)
    m = step.lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes


def _deep_loss(params, batch, rng):
    h, _ = lax.scan(lambda h, p: (jnp.tanh(h @ p["w"] + p["b"]), None), batch["x"], params)
    return jnp.mean((h - batch["y"]) ** 2), {}


def _unrolled_loss(params, batch, rng):
    h = batch["x"]
    for k in sorted(params):
        h = jnp.tanh(h @ params[k]["w"] + params[k]["b"])
    return jnp.mean((h - batch["y"]) ** 2), {}


def test_fsdp_peak_memory_on_scanned_and_unrolled_layers():
    width, layers, size = 256, 8, 64
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(size, width)).astype(np.float32),
        "y": rng.normal(size=(size, width)).astype(np.float32),
    }
    stacked = {
        "w": jnp.asarray(rng.normal(size=(layers, width, width)) * 0.05, jnp.float32),
        "b": jnp.zeros((layers, width), jnp.float32),
    }
    unrolled = {f"l{i}": {"w": stacked["w"][i], "b": stacked["b"][i]} for i in range(layers)}
    layer = (width * width + width) * 4
    state = 3 * layers * layer  # params + Adam's mu and nu
    # (params + Adam state) / n, the gradient slices, two gathered layers (the one in use and
    # the next), one layer's full gradient and the activations the backward keeps per layer.
    ideal = state / N + layers * layer / N + 3 * layer + layers * (size // N) * width * 4
    mesh = mesh_1d(N, "data")
    peak = {
        (shape, name): _peak(dp.Trainer(loss, optax.adam(1e-3), mesh=mesh, sync=sync), p, batch)
        for shape, loss, p in (
            ("scanned", _deep_loss, stacked),
            ("unrolled", _unrolled_loss, unrolled),
        )
        for name, sync in (("zero1", dp.sync.ZeRO1()), ("fsdp", dp.sync.FSDP()))
    }
    print({k: f"{v / 2**20:.2f} MiB" for k, v in peak.items()}, f"ideal {ideal / 2**20:.2f} MiB")
    assert peak["scanned", "fsdp"] <= 1.5 * ideal, (peak, ideal)
    assert peak["unrolled", "fsdp"] <= peak["unrolled", "zero1"], peak
    assert peak["scanned", "fsdp"] <= 0.5 * peak["scanned", "zero1"], peak


def _elements(tensor_type: str) -> int:
    """The element count of an MLIR ``tensor<AxBxf32>`` type."""
    return int(np.prod([int(d) for d in re.findall(r"(\d+)x", tensor_type)]))


def test_the_scan_gathers_one_layer_at_a_time():
    # The stacked leaves are gathered one layer at a time (one layer's w, D*D floats, in a
    # buffer of its own, as a block's matrices are: a packed buffer would be copied out of;
    # its b, D floats, with the other vectors), never whole (4 layers), and each layer's
    # gradient is reduce-scattered alone; per leaf with bucket_mb=None.
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(4, D, D)) * 0.1, jnp.float32),
        "b": jnp.zeros((4, D), jnp.float32),
    }
    batch = {"x": np.ones((N, D), np.float32), "y": np.zeros((N, D), np.float32)}
    for bucket_mb, sizes in ((25.0, {D * D, D}), (None, {D * D, D})):
        sync = dp.sync.FSDP(bucket_mb=bucket_mb)
        trainer = dp.Trainer(_deep_loss, optax.sgd(0.1), mesh=mesh_1d(N, "data"), sync=sync)
        state = trainer.init(params, jax.random.key(1))
        step, args = trainer.step_program(state, batch)
        text = step.lower(*args).as_text()
        gathered = re.findall(r"call @all_gather\w*\(.*\) -> (tensor<[^>]*>)", text)
        scattered = re.findall(r"call @reduce_scatter\w*\(.*\) : \((tensor<[^>]*>)\)", text)
        assert gathered and {_elements(t) for t in gathered} == sizes, (bucket_mb, gathered)
        assert scattered and {_elements(t) for t in scattered} == sizes, (bucket_mb, scattered)
        assert text.count("stablehlo.while") >= 2  # the forward's and the backward's loops


# --------------------------------------------------------------------------------- HSDP
@pytest.mark.parametrize("kind", ["lax.scan", "unrolled"])
def test_hsdp_equals_one_device_and_holds_a_quarter_per_device(kind):
    # Hybrid sharding on a (replica 2, shard 4) mesh made by jax.make_mesh (Explicit axes):
    # params and Adam state split over "shard" only, equal over "replica".
    if kind == "lax.scan":
        model, single, params = _model("lax.scan")
    else:
        model = dp.Linen(Twin(MLP), twin_loss)
        params, _ = model.init(jax.random.key(0), batches("mlp", 1, 8)[0])
        single = model
    data = batches("mlp", 4, 32)
    trainer = dp.Trainer(
        model,
        OPT,
        mesh=jax.make_mesh((2, 4), ("replica", "shard")),
        layout=dp.Layout(replicate="replica", shard="shard"),
        sync=dp.sync.FSDP(),
    )
    state = trainer.init(params, jax.random.key(1))
    devices = trainer.mesh.devices
    for leaf, d in zip(
        jax.tree_util.tree_leaves(state.params), trainer.sync.shard_dims(params), strict=True
    ):
        held = {s.device: np.asarray(s.data) for s in leaf.addressable_shards}
        if d is None:
            continue
        assert next(iter(held.values())).shape[d] * 4 == leaf.shape[d]
        for j in range(4):  # the two replicas of each slice are equal
            np.testing.assert_array_equal(held[devices[0, j]], held[devices[1, j]])
    for b in data:
        state, _ = trainer.step(state, b)
    want, _ = oracle(single, OPT, params, {}, data, n=N)
    diffs = twin_diffs(jax.device_get(state.params), want)
    assert max(diffs.values()) <= TOL, diffs


def test_the_per_layer_step_exports_for_gpu_and_runs_equal():
    # jax.export for ("cuda", "cpu"): the module a GPU gets (scans, per-layer gathers), run
    # here on CPU, gives the jitted step's params exactly; FSDP and HSDP.
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(4, D, D)) * 0.1, jnp.float32),
        "b": jnp.zeros((4, D), jnp.float32),
    }
    batch = {"x": rng.normal(size=(N, D)).astype(np.float32), "y": np.zeros((N, D), np.float32)}
    layouts = (
        (mesh_1d(N, "data"), dp.Layout(shard="data")),
        (
            jax.make_mesh((2, 4), ("replica", "shard")),
            dp.Layout(replicate="replica", shard="shard"),
        ),
    )
    for mesh, layout in layouts:
        trainer = dp.Trainer(_deep_loss, optax.sgd(0.1), mesh=mesh, layout=layout)
        step, args = trainer.step_program(trainer.init(params, jax.random.key(1)), batch)
        exported = jax.export.export(step, platforms=("cuda", "cpu"))(*args)
        text = exported.mlir_module()
        assert text.count("stablehlo.while") >= 2 and '"stablehlo.all_gather"' in text
        got, _ = exported.call(trainer.init(params, jax.random.key(1)), trainer.shard_batch(batch))
        want, _ = trainer.step(trainer.init(params, jax.random.key(1)), batch)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
