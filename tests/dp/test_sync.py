"""dp.sync: the strategies are values that check themselves, bind to an optimizer and a mesh,
and own their phases. (Their training results are checked against one device in
test_equivalence.py, test_zero1.py, test_fsdp.py and test_hooks.py.)"""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp
import optax
import pytest

from jaxcoll import dp
from jaxcoll.dp.hooks import PowerSGD
from tests.helpers import mesh_1d

STRATEGIES = [dp.sync.DDP, dp.sync.ZeRO1, dp.sync.FSDP]


def _loss(w, batch, rng):
    return jnp.mean((batch["x"] @ w) ** 2), {}


def test_each_strategy_is_a_frozen_keyword_only_value():
    for cls in STRATEGIES:
        assert list(inspect.signature(cls).parameters)[:3] == ["bucket_mb", "algorithm", "hook"]
        assert all(
            p.kind is inspect.Parameter.KEYWORD_ONLY
            for p in inspect.signature(cls).parameters.values()
        )
        value = cls(bucket_mb=4, algorithm="ring")
        assert value == cls(bucket_mb=4, algorithm="ring") != cls()
        assert hash(value) == hash(cls(bucket_mb=4, algorithm="ring"))
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.bucket_mb = 1.0
        with pytest.raises(TypeError):
            cls(4.0)  # keyword-only: no silent positional mix-up
    assert repr(dp.sync.DDP()) == (
        "DDP(bucket_mb=25.0, algorithm='auto', hook=None, mp_policy=None)"
    )
    assert dp.sync.FSDP().reshard_after_forward is True


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"bucket_mb": -1},
            ValueError,
            r"bucket_mb=-1 must be a positive number of MiB, or None "
            r"to turn bucketing off",
        ),
        ({"bucket_mb": float("inf")}, ValueError, r"bucket_mb=inf must be a positive number"),
        (
            {"bucket_mb": "25"},
            TypeError,
            r"bucket_mb must be a number of MiB or None, got '25' of "
            r"type str",
        ),
        ({"bucket_mb": True}, TypeError, r"bucket_mb must be a number of MiB or None"),
        ({"algorithm": "bogus"}, ValueError, r"algorithm='bogus' is not one of native, ring, tree"),
        ({"algorithm": 3}, TypeError, r"algorithm must be a string"),
        (
            {"hook": "powersgd"},
            TypeError,
            r"hook must be a communication hook \(a callable "
            r"hook\(state, bucket\) -> \(grads, state\)",
        ),
    ],
)
def test_fields_are_checked_at_construction(cls, kwargs, error, message):
    with pytest.raises(error, match=rf"dp\.sync\.{cls.__name__}: {message}"):
        cls(**kwargs)


@pytest.mark.parametrize("cls", [dp.sync.ZeRO1, dp.sync.FSDP], ids=lambda c: c.__name__)
def test_the_sharded_strategies_take_only_elementwise_hooks(cls):
    def needs_whole(state, bucket):
        return bucket.mean(), state

    for hook in (PowerSGD(rank=4), needs_whole):
        with pytest.raises(
            ValueError,
            match=rf"dp\.sync\.{cls.__name__}: hook=.* cannot be used "
            rf"with a sharded strategy: {cls.__name__} "
            rf"reduce-scatters each gradient.*Use this hook "
            rf"with dp\.sync\.DDP\(hook=\.\.\.\)",
        ):
            cls(hook=hook)
    cls(hook=dp.hooks.Compress(jnp.float16))  # a slice can be cast
    cls(hook=dp.hooks.AllReduceHook())
    dp.sync.DDP(hook=PowerSGD(rank=4))  # what DDP takes
    if cls is dp.sync.FSDP:
        with pytest.raises(
            TypeError,
            match=r"dp\.sync\.FSDP: reshard_after_forward must be "
            r"True or False, got 1",
        ):
            cls(reshard_after_forward=1)
        with pytest.raises(TypeError, match=r"dp\.sync\.FSDP: prefetch must be True or False"):
            cls(prefetch="yes")


def test_the_trainer_prepares_a_copy_and_the_value_stays_unprepared():
    value = dp.sync.ZeRO1(bucket_mb=1.0)
    with pytest.raises(
        RuntimeError,
        match=r"dp\.sync\.ZeRO1: this strategy is not prepared for an "
        r"optimizer and a layout yet; pass it to "
        r"dp\.Trainer\(\.\.\., sync=\.\.\.\)",
    ):
        _ = value.mesh
    mesh = mesh_1d(8, "data")
    trainer = dp.Trainer(_loss, optax.sgd(0.1), mesh=mesh, sync=value)
    assert trainer.sync == value and trainer.sync is not value
    assert trainer.sync.mesh is mesh and trainer.sync.axis_name == "data"
    assert trainer.sync.layout is trainer.layout
    assert trainer.sync.n == 8 and trainer.sync.bucket_bytes == 2**20
    with pytest.raises(RuntimeError, match="not prepared"):
        _ = value.optimizer
    # replace keeps the preparation and checks the new fields
    assert value.replace(bucket_mb=None).bucket_bytes is None
    assert trainer.sync.replace(bucket_mb=2.0).n == 8
    with pytest.raises(ValueError, match=r"dp\.sync\.ZeRO1: bucket_mb=0"):
        trainer.sync.replace(bucket_mb=0)


def test_phases_belong_to_the_strategy():
    hook = PowerSGD(rank=2, start_iter=3)
    layout = dp.Layout(replicate="data").bind(mesh_1d(8, "data"))
    sync = dp.sync.DDP(hook=hook).prepare(optax.sgd(0.1), layout)
    assert sync.phased and not dp.sync.DDP().phased
    assert dp.sync.DDP().phase(7) == dp.sync.DDP()
    before, after = sync.phase(2), sync.phase(3)
    assert before == sync.phase(0) and after == sync.phase(100) and before != after
    assert len({before, after, sync.phase(1)}) == 2  # hashable: one program per phase
    assert not before.phased and before.n == 8  # a phase is prepared as its strategy was


@pytest.mark.parametrize(
    "sync, message",
    [
        (
            dp.sync.FSDP,
            r"sync=dp\.sync\.FSDP is a class: pass a value, e.g. sync=dp\.sync\.FSDP\(\)",
        ),
        (
            "fsdp",
            r"sync must be a gradient-sync strategy \(dp\.sync\.DDP\(\), dp\.sync\.ZeRO1\(\) "
            r"or dp\.sync\.FSDP\(\)\), got 'fsdp' of type str",
        ),
    ],
)
def test_the_trainer_names_a_wrong_sync(sync, message):
    with pytest.raises(TypeError, match=rf"Trainer: {message}"):
        dp.Trainer(_loss, optax.sgd(0.1), sync=sync)


@pytest.mark.parametrize(
    "old", ["grad_sync", "bucket_mb", "grad_dtype", "comm_hook", "shard_optimizer", "shard_params"]
)
def test_the_old_flags_are_gone(old):
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{old}'"):
        dp.Trainer(_loss, optax.sgd(0.1), **{old: None})
