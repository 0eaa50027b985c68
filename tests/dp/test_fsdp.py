"""FSDP (``sync=dp.sync.FSDP()``): what each device holds, what the step gathers, and the
state around it (EMA, evaluate, to_module, checkpoints), and plain SGD against one device
(a gradient scale error fails here on its own). Its full equivalence with one device (SGD
and Adam, MLP and BatchNorm CNN, accum, ring) is in test_equivalence.py; over two processes
in tests/multihost/test_trainer.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcoll import dp
from tests.dp._models import MLP, batches, cross_entropy, max_rel_diff, oracle
from tests.dp.test_export import _executed, _functions
from tests.helpers import mesh_1d

N = 8


def _resident(tree) -> int:
    """Bytes of ``tree``'s arrays held by the first device (their addressable shards)."""
    dev = jax.devices()[0]
    return sum(
        s.data.nbytes
        for x in jax.tree_util.tree_leaves(tree)
        for s in x.addressable_shards
        if s.device == dev
    )


def _setup(optimizer=None, **kw):
    model = dp.Linen(MLP(), cross_entropy)
    data = batches("mlp", 4, 32)
    params, _ = model.init(jax.random.key(0), data[0])
    optimizer = optax.adam(1e-2) if optimizer is None else optimizer
    trainer = dp.Trainer(model, optimizer, mesh=mesh_1d(N, "data"), **kw)
    return trainer, params, data


def test_sgd_steps_move_the_params_as_one_device_does():
    # Plain SGD: the params move linearly in the gradient, so a gradient scale off by any
    # factor (8/7, a missing 1/n in the gather's backward) moves them that much more; Adam
    # would divide the factor away. The moves are compared, not the params, whose size would
    # hide a small factor.
    sgd = optax.sgd(0.1)
    trainer, params, data = _setup(sgd, sync=dp.sync.FSDP())
    state = trainer.init(params, jax.random.key(1))
    for batch in data:
        state, _ = trainer.step(state, batch)
    want, _ = oracle(trainer.model, sgd, params, {}, data, n=N)
    moved = lambda p: jax.tree_util.tree_map(  # noqa: E731
        lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), p, params
    )
    got_moves, want_moves = moved(jax.device_get(state.params)), moved(want)
    assert min(np.abs(m).max() for m in jax.tree_util.tree_leaves(want_moves)) > 1e-3
    diff = max_rel_diff(got_moves, want_moves)
    assert diff <= 1e-5, f"FSDP's SGD moves differ from one device's by {diff:.3g} (relative)"


def test_each_device_holds_one_nth_of_params_and_optimizer_state():
    rows = {}
    for name, sync in {
        "ddp": dp.sync.DDP(),
        "zero1": dp.sync.ZeRO1(),
        "fsdp": dp.sync.FSDP(),
    }.items():
        trainer, params, _ = _setup(sync=sync)
        state = trainer.init(params, jax.random.key(1))
        rows[name] = (_resident(state.params), _resident(state.opt_state))
        print(f"{name}: params {rows[name][0]} B, optimizer state {rows[name][1]} B per device")
    ddp, zero1, fsdp = (sum(rows[k]) for k in ("ddp", "zero1", "fsdp"))
    # The MLP's leaves all split over 8 but the last bias (4 floats), Adam's counts are
    # scalars: FSDP holds 1/8 of DDP's bytes plus those.
    assert fsdp <= 1.2 / N * ddp, rows
    assert rows["zero1"][0] == rows["ddp"][0] and rows["zero1"][1] <= 1.2 / N * rows["ddp"][1]
    assert fsdp < zero1 < ddp


def _gathers(trainer, state, batch) -> int:
    step, args = trainer.step_program(state, batch)
    funcs = _functions(step.lower(*args).as_text())
    return _executed(funcs, "main", "stablehlo.all_gather")


def test_the_backward_gathers_the_params_again_instead_of_keeping_them():
    # Per leaf (bucket_mb=None), then by buckets (the default 25 MiB: one bucket here).
    trainer, params, data = _setup(sync=dp.sync.FSDP(bucket_mb=None))
    state = trainer.init(params, jax.random.key(1))
    split = sum(d is not None for d in trainer.sync.shard_dims(params))
    assert split == len(jax.tree_util.tree_leaves(params)) - 1  # all but the last bias
    again = _gathers(trainer, state, data[0])
    keeping, _, _ = _setup(sync=dp.sync.FSDP(bucket_mb=None, reshard_after_forward=False))
    kept = _gathers(keeping, state, data[0])  # the same state: FSDP places it alike
    # Kept whole: one gather per split leaf. Regathered: the backward needs the kernels of
    # Dense_1 and Dense_2 again (for the gradient of their inputs) and gathers them anew;
    # the biases and the first kernel are not needed by the backward.
    assert kept == split and again == split + 2, (kept, again)
    bucketed, _, _ = _setup(sync=dp.sync.FSDP())
    kept_bucketed, _, _ = _setup(sync=dp.sync.FSDP(reshard_after_forward=False))
    # One bucket: one gather for the forward, one for the two kernels the backward needs.
    assert _gathers(kept_bucketed, state, data[0]) == 1
    assert _gathers(bucketed, state, data[0]) == 2


def test_ema_evaluate_to_module_and_resume_with_sharded_params(tmp_path):
    trainer, params, data = _setup(sync=dp.sync.FSDP(), extra=dp.ema(0.5))
    ddp, _, _ = _setup(extra=dp.ema(0.5))
    state = trainer.init(params, jax.random.key(1))
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.shape == (16, 32) and not kernel.is_fully_replicated
    assert state.extra["Dense_0"]["kernel"].sharding == kernel.sharding  # the EMA too
    full, _ = trainer.fit(state, data, steps=4, checkpoint=dp.Checkpointer(tmp_path / "a", every=2))
    ref = ddp.init(params, jax.random.key(1))
    for b in data:
        ref, _ = ddp.step(ref, b)
    assert max_rel_diff(full.params, ref.params) <= 1e-5
    assert max_rel_diff(full.extra, ref.extra) <= 1e-5
    got, want = trainer.evaluate(full, data[:2]), ddp.evaluate(ref, data[:2])
    assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want)
    module = trainer.to_module(full)  # a bound linen module with the whole params
    np.testing.assert_array_equal(
        module.variables["params"]["Dense_0"]["kernel"],
        np.asarray(full.params["Dense_0"]["kernel"]),
    )
    # Stopped after step 2 (its checkpoint), resumed by a new Trainer: bit-identical.
    trainer.fit(
        trainer.init(params, jax.random.key(1)),
        data,
        steps=2,
        checkpoint=dp.Checkpointer(tmp_path / "b", every=2),
    )
    again = _setup(sync=dp.sync.FSDP(), extra=dp.ema(0.5))[0]
    resumed, _ = again.fit(
        again.init(params, jax.random.key(1)),
        data,
        steps=4,
        checkpoint=dp.Checkpointer(tmp_path / "b", every=2),
    )
    for a, b in zip(
        jax.tree_util.tree_leaves(jax.device_get(resumed)),
        jax.tree_util.tree_leaves(jax.device_get(full)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    assert resumed.params["Dense_0"]["kernel"].sharding == kernel.sharding


_DEF = re.compile(r"^\s*(%[\w]+) = (?:stablehlo\.(\w+)|(?:func\.)?call @(\w+))[ (](.*)$", re.M)


def _scatters_of_divided(text: str) -> list[bool]:
    """Per reduce-scatter of the lowered step: whether its operand was made, through the
    packing's reshapes, transposes, concatenations and casts, from a division."""
    found = []
    for body in _functions(text).values():
        defs = {m.group(1): (m.group(2) or m.group(3), m.group(4)) for m in _DEF.finditer(body)}
        for op, rest in defs.values():
            if op != "reduce_scatter":
                continue
            todo, divided = re.findall(r"%\w+", rest.split(":")[0]), False
            while todo:
                kind, args = defs.get(todo.pop(), (None, ""))
                divided |= kind == "divide"
                if kind in ("reshape", "transpose", "concatenate", "convert"):
                    todo += re.findall(r"%\w+", args.split(":")[0])
            found.append(divided)
    return found


def test_the_mean_divides_the_slice_after_the_reduce_scatter():
    # In the gradients' own dtype (the fp32 master's, also under a bf16 policy that reduces
    # in fp32) the division by n runs on each rank's slice after the sum: 1/n of the bytes,
    # one rounding. Cast to another wire dtype it runs before, so the sum stays in range.
    bf16 = dp.sync.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    bf16_fp32 = dp.sync.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    for sync, before in (
        (dp.sync.FSDP(), False),
        (dp.sync.FSDP(hook=dp.hooks.Compress(jnp.bfloat16)), True),
        (dp.sync.FSDP(mp_policy=bf16), True),  # reduced in bf16
        (dp.sync.FSDP(mp_policy=bf16_fp32), False),  # in the fp32 master's own dtype
        (dp.sync.ZeRO1(), False),
        (dp.sync.ZeRO1(mp_policy=bf16), True),
        (dp.sync.ZeRO1(mp_policy=bf16_fp32), False),
    ):
        trainer, params, data = _setup(optax.sgd(0.1), sync=sync)
        step, args = trainer.step_program(trainer.init(params, jax.random.key(1)), data[0])
        found = _scatters_of_divided(step.lower(*args).as_text())
        assert found and found == [before] * len(found), (sync, found)
