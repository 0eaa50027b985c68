"""Checkpoints that keep what a stopped run did.

A damaged newest checkpoint (files truncated, emptied or deleted) does not block a resume:
it is skipped with a warning naming its step, the newest good one is restored, the damaged
step is saved again when training reaches it, and the run ends bit-identical to one that was
never stopped. A preempted run (SIGTERM) saves the step it stopped at, between the periodic
checkpoints, and its restart resumes there."""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcoll import dp
from tests.helpers import mesh_1d

ROOT = Path(__file__).resolve().parents[2]


def _loss(w, batch, rng):
    return jnp.mean((batch["x"] @ w["w"] - batch["y"]) ** 2), {}


def _setup():
    rng = np.random.default_rng(0)
    data = dp.Batches(
        {
            "x": rng.normal(size=(64, 3)).astype(np.float32),
            "y": rng.normal(size=64).astype(np.float32),
        },
        16,
        seed=1,
    )
    trainer = dp.Trainer(_loss, optax.adam(0.1), mesh=mesh_1d(8, "data"))
    fresh = lambda: trainer.init({"w": jnp.zeros(3)}, jax.random.key(0))  # noqa: E731
    return trainer, fresh, data


def _same(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def _read(ckpt: dp.Checkpointer, step: int, template) -> dp.TrainState:
    """The checkpoint of ``step`` exactly (no fallback to another step)."""
    return ckpt.restore(step, template)


def _damage(step_dir: Path, target: str, mode: str) -> None:
    paths = sorted(step_dir.glob(target))
    assert paths, (step_dir, target)
    for p in paths:
        if mode == "delete":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        else:
            data = p.read_bytes()
            p.write_bytes(data[: len(data) // 2] if mode == "truncate" else b"")


DAMAGE = [
    (t, m)
    for t in ("default/_METADATA", "default/manifest.ocdbt", "default/d/*")
    for m in ("truncate", "empty", "delete")
]
DAMAGE += [("default", "delete")]


# A failed orbax restore leaves tensorstore callbacks that later hit asyncio's closed event
# loop ("Exception ignored ... Event loop is closed"): orbax's noise, not a failure here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path):
    trainer, fresh, data = _setup()
    ref, _ = trainer.fit(fresh(), data, steps=15)  # never stopped
    pristine = tmp_path / "pristine"
    step10 = jax.device_get(
        trainer.fit(fresh(), data, steps=10, checkpoint=dp.Checkpointer(pristine, every=5))[0]
    )
    ckpt = dp.Checkpointer(pristine)
    assert ckpt.manager.all_steps() == [5, 10]
    step5 = _read(ckpt, 5, fresh())
    assert _same(_read(ckpt, 10, fresh()), step10)
    ckpt.close()

    for i, (target, mode) in enumerate(DAMAGE):
        run = tmp_path / f"run{i}"
        shutil.copytree(pristine, run)
        _damage(run / "10", target, mode)
        ckpt = dp.Checkpointer(run)
        with pytest.warns(
            RuntimeWarning,
            match=r"checkpoint of step 10 in .* cannot be "
            r"restored .*skipping it",
        ):
            got = ckpt.restore_latest(fresh())
        ckpt.close()
        assert int(got.step) == 5 and _same(got, step5), (target, mode)
    gc.collect()  # the failed restores' leftover tensorstore coroutines go here, not later

    # A whole resume: warned, restored from step 5 (the newest good one: the run's first
    # step is 6), the damaged step 10 saved again when training reached it (read back, it
    # is the never-stopped run's step 10), and the result bit-identical to that run.
    run = tmp_path / "resume"
    shutil.copytree(pristine, run)
    _damage(run / "10", "default/_METADATA", "truncate")
    with pytest.warns(RuntimeWarning, match=r"step 10"):
        resumed, hist = trainer.fit(
            fresh(), data, steps=15, checkpoint=dp.Checkpointer(run, every=5)
        )
    assert [h["step"] for h in hist] == list(range(6, 16))
    assert _same(resumed, ref)
    ckpt = dp.Checkpointer(run)
    assert ckpt.manager.all_steps() == [10, 15]
    try:
        again = _read(ckpt, 10, fresh())
    except Exception as e:
        pytest.fail(
            f"step 10 was not saved again after the resume: reading it fails with "
            f"{type(e).__name__}: {str(e)[:200]}"
        )
    assert int(again.step) == 10 and _same(again, step10)
    assert _same(ckpt.restore_latest(fresh()), ref)  # step 15, the run's end
    ckpt.close()

    # Nothing restorable: an error listing every step, never a silent fresh start.
    _damage(run / "10", "default/_METADATA", "empty")
    _damage(run / "15", "default/manifest.ocdbt", "delete")
    with (
        pytest.warns(RuntimeWarning),
        pytest.raises(
            RuntimeError,
            match=r"no checkpoint in .* reads back:\n"
            r"  step 15: .*\n  step 10: .*\nThe template matches what each one's metadata "
            r"holds; their files fail to read .* Check one first: dp.Checkpointer\(.*\)"
            r"\.restore\(15, template\)",
        ),
    ):
        trainer.fit(fresh(), data, steps=20, checkpoint=dp.Checkpointer(run, every=5))


def test_a_template_that_does_not_match_is_named_and_the_checkpoints_are_kept(tmp_path):
    # A template that cannot receive the checkpoint (the params alone, another layer width,
    # another dtype) is the caller's mistake: the error names the leaf and the saved and
    # given shapes, nothing is marked damaged or advised for removal, and the right
    # template restores the newest step afterwards.
    trainer, fresh, data = _setup()
    run = tmp_path / "run"
    end, _ = trainer.fit(fresh(), data, steps=10, checkpoint=dp.Checkpointer(run, every=5))
    wider = trainer.init({"w": jnp.zeros(4)}, jax.random.key(0))
    half = trainer.init({"w": jnp.zeros(3, jnp.bfloat16)}, jax.random.key(0))
    cases = [
        (
            fresh().params,
            TypeError,
            r"template must be the whole dp.TrainState that the "
            r"checkpoint of step 10 in .* holds \(comm_state, extra, model_state, opt_state, "
            r"params, rng, step\), got a dict instead \(leaves w\); nothing was restored, and "
            r"the checkpoints are intact: do not remove them\. Pass the state the run trains",
        ),
        (
            wider,
            ValueError,
            r"the template does not match the checkpoint of step 10 in .* "
            r"\(read from its metadata; nothing was restored, and the checkpoints are intact: do "
            r"not remove them\): params/w: saved \(3,\) float32, given \(4,\) float32; "
            r"opt_state/0/mu/w: saved \(3,\) float32, given \(4,\) float32",
        ),
        (half, ValueError, r"params/w: saved \(3,\) float32, given \(3,\) bfloat16"),
    ]
    for template, kind, message in cases:
        ckpt = dp.Checkpointer(run)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(kind, match=message) as raised:
                ckpt.restore_latest(template)
        assert not caught, [str(w.message) for w in caught]  # no step called damaged
        assert "remove that step" not in str(raised.value)
        assert ckpt.damaged == set()
        ckpt.close()
    # fit with the wider state: the same error before any step, and nothing saved over.
    with pytest.raises(ValueError, match=r"params/w: saved \(3,\) float32, given \(4,\)"):
        trainer.fit(wider, data, steps=15, checkpoint=dp.Checkpointer(run, every=5))
    ckpt = dp.Checkpointer(run)
    assert ckpt.manager.all_steps() == [5, 10]
    got = ckpt.restore_latest(fresh())
    assert int(got.step) == 10 and _same(got, end)
    with pytest.raises(
        ValueError,
        match=r"Checkpointer.restore: step=7 has no checkpoint in "
        r".* \(saved: \[5, 10\]\); pass one of those\.",
    ):
        ckpt.restore(7, fresh())
    assert _same(ckpt.restore(5, fresh()), _read(ckpt, 5, fresh()))
    ckpt.close()


def test_a_save_is_asynchronous_and_committed_within_two_steps(tmp_path):
    # save returns before the commit (the step's folder appears once it is committed), fit's
    # at_step waits for it two steps after the save, wait() at any time; with
    # enable_async_checkpointing=False every save returns committed.
    trainer, fresh, data = _setup()
    state = fresh()
    ckpt = dp.Checkpointer(tmp_path / "a", every=None)
    ckpt.save(state.replace(step=jnp.asarray(4, jnp.int32)))
    assert ckpt._pending == 4 and ckpt.committed is None  # under way
    ckpt.at_step(5)  # one step later: not waited for
    assert ckpt._pending == 4
    ckpt.at_step(6)  # two steps later: committed
    assert ckpt._pending is None and ckpt.committed == 4
    assert ckpt.manager.all_steps() == [4]
    ckpt.save(state.replace(step=jnp.asarray(8, jnp.int32)))
    ckpt.wait()
    assert ckpt.committed == 8 and ckpt.manager.all_steps() == [4, 8]
    ckpt.wait()  # nothing under way: a no-op
    ckpt.close()

    blocking = dp.Checkpointer(tmp_path / "s", every=None, enable_async_checkpointing=False)
    blocking.save(state)
    assert blocking._pending is None and blocking.committed == 0
    assert blocking.manager.all_steps() == [0]
    blocking.close()
    with pytest.raises(
        TypeError,
        match=r"Checkpointer: enable_async_checkpointing must be True or False, got 'no' of "
        r"type str instead\.",
    ):
        dp.Checkpointer(tmp_path / "x", enable_async_checkpointing="no")


# The preempted run, in a process of its own (its SIGTERM and exit are its own): this file's
# _setup, fit with a checkpoint every EVERY steps, and a callback that sends SIGTERM after
# step AT and waits until jaxcoll's handler has recorded it, so the stop step is fixed.
EVERY, AT, STEPS = 4, 5, 10
PREEMPTED = f"""
import os, signal, sys, time
import tests.conftest  # 8 simulated CPU devices, as here
import jaxcoll
from jaxcoll import dp
from tests.dp.test_checkpoint import _setup

def preempt(step, metrics):
    if step == {AT}:
        os.kill(os.getpid(), signal.SIGTERM)
        while not jaxcoll.preemption_requested():
            time.sleep(0.01)

trainer, fresh, data = _setup()
trainer.fit(fresh(), data, steps={STEPS}, checkpoint=dp.Checkpointer(sys.argv[1], every={EVERY}),
            callbacks=[preempt])
"""


def test_sigterm_saves_the_step_it_stopped_at_and_the_restart_resumes_there(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-c", PREEMPTED, str(run)],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 143, out.stderr[-3000:]
    found = re.search(r"Trainer.fit: SIGTERM: saved a checkpoint at step (\d+)", out.stderr)
    assert found, out.stderr[-3000:]
    # fit checks for a stop after dispatching each step; the callback of step AT runs after
    # step AT + 1 was dispatched (prefetch), so the run stops after step AT + 2.
    stop = int(found.group(1))
    assert stop == AT + 2 and stop % EVERY, stop  # between two periodic checkpoints

    trainer, fresh, data = _setup()
    ckpt = dp.Checkpointer(run)
    saved = ckpt.manager.all_steps()
    assert stop in saved, f"no checkpoint of the preempted step {stop} (saved: {saved})"
    got = _read(ckpt, stop, fresh())
    ckpt.close()
    want, _ = trainer.fit(fresh(), data, steps=stop)  # never stopped
    assert int(got.step) == stop and _same(got, want)
    # The restart: the same call again resumes at the preempted step, not at step EVERY.
    resumed, hist = trainer.fit(
        fresh(), data, steps=STEPS, checkpoint=dp.Checkpointer(run, every=EVERY)
    )
    assert [h["step"] for h in hist] == list(range(stop + 1, STEPS + 1))
    ref, _ = trainer.fit(want, data, steps=STEPS)
    assert _same(resumed, ref)
