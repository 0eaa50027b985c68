"""examples/gpt.py: its layouts train the GPT to the single-device params, and its checkpoint
moves between layouts.

The example's ``--tiny`` model (2 blocks, width 32) runs in-process on the 8 simulated
devices: one compiled step per layout, each compared with ``--layout single`` (one device,
the model dense) after the same steps, within 1e-5 (AdamW, clipping, warmup and accumulation
as the example has them). The data-only layouts are tests/dp/test_layout.py's (dp8, fsdp8,
dp2xfsdp4 on its model); the whole matrix on this model runs in benchmarks/nd.py, and
tests/multihost/test_trainer.py runs the example under jaxcoll-run on 2 x 4 devices.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest

PATH = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
STEPS = 3
TOL = 1e-5


def _load():
    spec = importlib.util.spec_from_file_location("gpt_example", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.use_tiny()
    return module


gpt = _load()


def _train(name: str, steps: int = STEPS):
    trainer = gpt.trainer_for(name)
    state = trainer.init(gpt.init_params(), jax.random.key(0))
    for batch in gpt.batches("train", steps, seed=1):
        state, metrics = trainer.step(state, batch)
    return trainer.host_params(state), float(metrics["loss"])


def _flat(tree):
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _max_rel(got, want):
    return max(
        float(np.max(np.abs(got[k] - w)) / (np.max(np.abs(w)) + 1e-12)) for k, w in want.items()
    )


@pytest.fixture(scope="module")
def single():
    params, loss = _train("single")
    return _flat(params), loss


@pytest.mark.parametrize("name", ["fsdp4xtp2", "dp2xtp2xpp2", "fsdp2xtp2xpp2"])
def test_a_layout_trains_the_single_device_params(name, single):
    params, loss = _train(name)
    assert _max_rel(_flat(params), single[0]) <= TOL
    assert abs(loss - single[1]) <= 1e-5


@pytest.mark.parametrize("name", ["dp1xcp8", "fsdp2xcp2xtp2"])
def test_a_context_layout_trains_the_single_device_params(name, single):
    # Each sequence split over the context axis (2 of the 16 characters per device at cp8):
    # ring attention over the whole sequence, the positions from context_positions, the
    # gradients and the loss averaged over the context axis as over a data axis.
    trainer = gpt.trainer_for(name)
    assert trainer.layout.context_axis == "context"
    params, loss = _train(name)
    assert _max_rel(_flat(params), single[0]) <= TOL
    assert abs(loss - single[1]) <= 1e-5


@pytest.fixture
def experts():
    # With the example's accumulation (2): the load-balancing loss is a product of each
    # micro-batch's means, and micro-batch j is the same global rows on every layout.
    gpt.EXPERTS = 8
    try:
        yield
    finally:
        gpt.EXPERTS = 0


def test_an_moe_gpt_trains_the_single_device_params_with_its_experts_split(experts):
    # --experts 8: every block's MLP a mixture of 8 experts (top-2, dropless, the
    # load-balancing loss in the loss); fsdp8 holds one expert per device (FSDP for the
    # rest); one device runs them all. (HSDP and ZeRO-1 beside experts:
    # tests/dp/test_expert_training.py.)
    want, want_loss = _train("single")
    trainer = gpt.trainer_for("fsdp8")
    state = trainer.init(gpt.init_params(), jax.random.key(0))
    w_in = state.params["blocks"]["MoE_0"]["w_in"]
    assert w_in.sharding.shard_shape(w_in.shape)[1] == 1  # one expert per device
    for batch in gpt.batches("train", STEPS, seed=1):
        state, metrics = trainer.step(state, batch)
    assert _max_rel(_flat(trainer.host_params(state)), _flat(want)) <= TOL
    assert abs(float(metrics["loss"]) - want_loss) <= 1e-5


def test_1f1b_trains_the_single_device_params(single):
    # The pipeline's own 1F1B backward (parallel.pipeline_loss) inside the Trainer, under
    # FSDP x tensor x pipeline with gradient accumulation; the layout's schedule.
    params, loss = _train("fsdp2xtp2xpp2:1f1b2")
    assert _max_rel(_flat(params), single[0]) <= TOL
    assert abs(loss - single[1]) <= 1e-5


def test_the_checkpoint_resumes_in_another_layout(tmp_path, single):
    ckpt, out = tmp_path / "ckpt", tmp_path / "params.npz"
    common = ["--tiny", "--eval-every", "0", "--ckpt", str(ckpt)]
    gpt.main([*common, "--layout", "fsdp4xtp2", "--steps", "2"])
    gpt.main([*common, "--layout", "dp2xtp2xpp2:1f1b2", "--steps", str(STEPS), "--out", str(out)])
    assert _max_rel(dict(np.load(out)), single[0]) <= TOL


def test_a_bad_layout_is_named():
    with pytest.raises(SystemExit, match=r"--layout 'tp2x3'"):
        gpt.layout("tp2x3")
    with pytest.raises(SystemExit, match=r"uses 4 devices, and there are 8"):
        gpt.layout("dp2xtp2")
    with pytest.raises(SystemExit, match=r"the schedule is one of"):
        gpt.layout("dp2xtp2xpp2:2f2b")
    assert gpt.layout("fsdp2xtp2xpp2:zb2") == gpt.dp.Layout(
        shard=2, tensor=2, pipeline=2, schedule=gpt.parallel.ZeroBubble(gpt.MICRO)
    )
    assert gpt.layout("fsdp2xcp2xtp2") == gpt.dp.Layout(shard=2, context=2, tensor=2)


def test_precision_picks_the_strategy_and_needs_fsdp():
    sync = gpt.trainer_for("fsdp8", "int8-grads").sync
    assert sync.quantize == gpt.dp.Quantize(grads=gpt.jnp.int8) and sync.mp_policy is None
    sync = gpt.trainer_for("dp2xfsdp4", "bf16").sync
    assert sync.mp_policy.param_dtype == gpt.jnp.bfloat16 and sync.shard_axis_name == "shard"
    with pytest.raises(SystemExit, match="needs a layout with fsdp"):
        gpt.trainer_for("dp8", "fp8-params")
    with pytest.raises(SystemExit, match="one of"):
        gpt.trainer_for("fsdp8", "fp4")


def test_sync_picks_a_semisynchronous_strategy():
    sync = gpt.trainer_for("dp2xfsdp4", sync="diloco8:int8").sync
    assert isinstance(sync, gpt.dp.sync.DiLoCo) and sync.every == 8
    assert isinstance(sync.inner, gpt.dp.sync.FSDP)
    assert sync.quantize == gpt.dp.Quantize(grads=gpt.jnp.int8)
    # The recipe benchmarks/diloco.py measures: 50 synchronous steps first, the outer step
    # Nesterov at (0.8, 0.3), whose first update of a gradient g is -0.8 * (1 + 0.3) * g, and
    # the inner rates tripled.
    assert sync.warmup == 50
    update, _ = sync.outer.update({"w": gpt.jnp.ones(())}, sync.outer.init({"w": 0.0}))
    assert float(update["w"]) == pytest.approx(-0.8 * 1.3)
    peak = gpt.schedule(gpt.SEMISYNC_LR_SCALE)(gpt.WARMUP)
    assert float(peak) == pytest.approx(3 * gpt.LR)
    with pytest.raises(SystemExit, match="no replicate axis"):
        gpt.trainer_for("fsdp8", sync="diloco8")
