"""Trainer behaviour besides equivalence: its signature, HLO collectives, checkpoints, init,
rng, errors."""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcoll import dp
from tests.dp._models import MLP, batches, cross_entropy
from tests.dp.test_export import assert_whole_buckets
from tests.helpers import mesh_1d


def _mlp_trainer(**kw):
    model = dp.Linen(MLP(), cross_entropy)
    data = batches("mlp", 4, 32)
    params, ms = model.init(jax.random.key(0), data[0])
    trainer = dp.Trainer(model, optax.adam(1e-2), mesh=mesh_1d(8, "data"), **kw)
    return trainer, params, ms, data


def test_the_signature_takes_a_strategy_value_and_at_most_nine_keywords():
    sig = inspect.signature(dp.Trainer)
    keywords = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert "sync" in sig.parameters and len(keywords) <= 9, list(sig.parameters)
    assert sig.parameters["sync"].default is None  # the layout's: DDP without a shard role
    assert type(dp.Trainer(lambda w, b, r: (w, {}), optax.sgd(0.1)).sync) is dp.sync.DDP
    assert list(sig.parameters)[:2] == ["loss_fn", "optimizer"]
    fit = inspect.signature(dp.Trainer.fit)
    assert "checkpoint" in fit.parameters and "checkpoint_dir" not in fit.parameters


@pytest.mark.parametrize(
    "bucket_mb, grad_dtype", [(25.0, None), (None, None), (0.002, None), (0.002, jnp.bfloat16)]
)
def test_every_bucket_is_all_reduced_whole_in_the_compiled_hlo(bucket_mb, grad_dtype):
    hook = None if grad_dtype is None else dp.hooks.Compress(grad_dtype)
    trainer, params, ms, data = _mlp_trainer(
        sync=dp.sync.DDP(bucket_mb=bucket_mb, algorithm="native", hook=hook)
    )
    state = trainer.init(params, jax.random.key(1), model_state=ms)
    step, args = trainer.step_program(state, data[0])
    hlo = step.lower(*args).compile()
    ops = re.findall(r"^\s*%\S+ = (\(.*?\)|\S+) all-reduce\(", hlo.as_text(), re.M)
    # shapes only: XLA:CPU reduces bf16 in f32 (the bf16 wire dtype is checked in the jaxpr)
    groups = [sorted(re.findall(r"\w+(\[[\d,]*\])", op)) for op in ops]
    metrics = "[2]"  # loss and accuracy, packed in one vector; XLA may merge it into a bucket
    grad_groups = [sorted(g for g in group if g != metrics) for group in groups]
    leaves = jax.tree_util.tree_leaves(params)
    buckets = dp.plan_buckets(leaves, None if bucket_mb is None else bucket_mb * 2**20)
    # XLA:CPU's combiner may merge independent buckets; it never splits one
    assert_whole_buckets([g for g in grad_groups if g], leaves, buckets)
    jaxpr = jax.make_jaxpr(step)(*args)
    wire = jnp.bfloat16 if grad_dtype is not None else jnp.float32
    psums = [dtype for name, dtype in _collectives(jaxpr.jaxpr) if name.startswith("psum")]
    assert sum(d == wire for d in psums) == len(leaves) + (grad_dtype is None)  # + metrics
    if bucket_mb == 25.0:
        assert len(buckets) == 1
    elif bucket_mb is None:
        assert len(buckets) == len(leaves)
    else:
        assert 1 < len(buckets) < len(leaves)


def _collectives(jaxpr):
    """(primitive name, dtype of the first operand) of every collective eqn, recursively."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith(("psum", "all_", "ppermute", "reduce_scatter")):
            out.append((eqn.primitive.name, eqn.invars[0].aval.dtype))
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)
            if hasattr(sub, "eqns"):
                out.extend(_collectives(sub))
    return out


def _same(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


class _Crash(dp.Batches):
    """Batches that fail at one step, as a killed process would."""

    crash_at = 13

    def __getitem__(self, step):
        if step == self.crash_at:
            raise RuntimeError("simulated crash")
        return super().__getitem__(step)


@pytest.mark.parametrize("sync", [dp.sync.DDP(), dp.sync.ZeRO1()], ids=["ddp", "zero1"])
def test_crash_and_resume_is_bit_identical(tmp_path, sync):
    model = dp.Linen(MLP(), cross_entropy)
    raw = batches("mlp", 1, 160)[0]
    params, ms = model.init(jax.random.key(0), raw)
    trainer = dp.Trainer(
        model, optax.adam(1e-2), mesh=mesh_1d(8, "data"), sync=sync, extra=dp.ema(0.9)
    )  # EMA: saved too
    fresh = lambda: trainer.init(params, jax.random.key(1), model_state=ms)  # noqa: E731
    ref, _ = trainer.fit(fresh(), dp.Batches(raw, 32, seed=3), steps=20, progress=False)
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.fit(
            fresh(),
            _Crash(raw, 32, seed=3),
            steps=20,
            checkpoint=dp.Checkpointer(tmp_path, every=5),
            progress=False,
        )
    ckpt = dp.Checkpointer(tmp_path)
    assert ckpt.manager.latest_step() == 10  # the crash at step 13 lost steps 11-13
    ckpt.close()
    resumed, hist = trainer.fit(
        fresh(),
        dp.Batches(raw, 32, seed=3),
        steps=20,
        checkpoint=dp.Checkpointer(tmp_path, every=5),
        progress=False,
    )
    assert [h["step"] for h in hist] == list(range(11, 21))
    assert int(resumed.step) == 20
    assert _same(resumed, ref)
    # and the check can fail: one more step is not the same state
    more, _ = trainer.step(resumed, dp.Batches(raw, 32, seed=3)[20])
    assert not _same(more.params, ref.params)


def test_init_broadcasts_rank0_so_different_ranks_end_identical():
    trainer, params, ms, data = _mlp_trainer()
    # each rank starts from different params (rank r: params + r)
    per_rank = jax.tree_util.tree_map(
        lambda a: np.stack([np.asarray(a) + r for r in range(8)]), params
    )
    state = trainer.init(per_rank, jax.random.key(1), per_rank=True)
    for leaf, want in zip(
        jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(params), strict=True
    ):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 8
        for s in shards:
            np.testing.assert_array_equal(s, np.asarray(want))
    with pytest.raises(ValueError, match="leading axis of size 8"):
        trainer.init(params, jax.random.key(1), per_rank=True)


def test_dropout_streams_differ_per_rank_and_reproduce():
    mesh = mesh_1d(8, "data")

    def loss_fn(w, batch, rng):
        keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
        return jnp.mean(jnp.where(keep, batch["x"], 0.0) * w), {"kept": jnp.mean(keep)}

    x = np.ones((8, 64), np.float32)

    def run():
        trainer = dp.Trainer(loss_fn, optax.sgd(1.0), mesh=mesh)
        state = trainer.init(jnp.ones(()), jax.random.key(7))
        state, m = trainer.step(state, {"x": x})
        return float(state.params), float(m["kept"])

    w1, kept1 = run()
    w2, kept2 = run()
    assert (w1, kept1) == (w2, kept2)  # reproducible
    # the gradient is the global fraction kept / 1; identical masks on every rank would give
    # a fraction that is a multiple of 1/64 (one rank's mask), per-rank masks give k/512.
    assert 0.3 < kept1 < 0.7
    assert round(kept1 * 512) % 8 != 0 or round(kept2 * 512) % 8 != 0
    np.testing.assert_allclose(1.0 - w1, kept1, rtol=1e-6)


def test_errors_name_the_argument_and_the_fix():
    trainer, params, ms, data = _mlp_trainer(accum_steps=2)
    state = trainer.init(params, jax.random.key(1), model_state=ms)
    with pytest.raises(
        ValueError,
        match=r"30 examples.*8 devices x accum_steps=2.*multiple "
        r"of 16",
    ):
        trainer.step(state, {k: v[:30] for k, v in data[0].items()})
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        dp.Trainer(cross_entropy, "adam")
    with pytest.raises(ValueError, match="accum_steps=0"):
        dp.Trainer(cross_entropy, optax.sgd(1.0), accum_steps=0)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        dp.Trainer(cross_entropy, optax.sgd(1.0), mesh=mesh_1d(8, "x"))
    with pytest.raises(ValueError, match="exactly one of steps"):
        trainer.fit(state, data, progress=False)


@pytest.mark.parametrize("sync", [dp.sync.DDP(), dp.sync.FSDP()], ids=["ddp", "fsdp"])
def test_a_one_device_mesh_trains_as_plain_optax(sync):
    # One rank: the collectives over the data axis are identities typed invariant (as
    # lax.psum over one device types them), so the step's replicated outputs check.
    def loss(w, batch, rng):
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2), {}

    rng = np.random.default_rng(0)
    data = [
        {
            "x": rng.normal(size=(8, 3)).astype(np.float32),
            "y": rng.normal(size=8).astype(np.float32),
        }
        for _ in range(3)
    ]
    trainer = dp.Trainer(loss, optax.sgd(0.1), mesh=mesh_1d(1, "data"), sync=sync, accum_steps=2)
    state = trainer.init(jnp.ones(3), jax.random.key(0))
    w = jnp.ones(3)
    for batch in data:
        state, _ = trainer.step(state, batch)
        w = w - 0.1 * jax.grad(lambda w, b=batch: loss(w, b, None)[0])(w)
    np.testing.assert_allclose(np.asarray(state.params), w, rtol=1e-6)


def test_a_placed_batch_goes_in_as_it_is_and_a_host_batch_is_placed():
    trainer, params, _, data = _mlp_trainer()
    placed = trainer.shard_batch(data[0])
    assert all(x.sharding == trainer.batch_sharding for x in jax.tree_util.tree_leaves(placed))
    assert trainer.shard_batch(placed) is placed  # no device_put of what is placed already
    other = jax.device_put(data[0], jax.sharding.NamedSharding(trainer.mesh, jax.P()))
    again = trainer.shard_batch(other)  # replicated: resharded to the batch's split
    assert again is not other and jax.tree_util.tree_leaves(again)[0].sharding == (
        trainer.batch_sharding
    )
    losses = []
    for batch in (data[0], placed, placed):  # a host batch, then the placed one twice
        _, metrics = trainer.step(trainer.init(params, jax.random.key(0)), batch)
        losses.append(float(metrics["loss"]))
    assert losses[0] == losses[1] == losses[2], losses
