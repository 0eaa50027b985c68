"""Checkpointer.wait (and at_step, which calls it) returns only once the save is committed.

One process, no timing: orbax's background commit is held at a gate until the thread that
saved joins another thread (what waiting for the commit is), so a ``wait`` that does not wait
returns while the commit is deterministically unfinished: the step's folder is still
``<step>.orbax-checkpoint-tmp`` and a fresh Checkpointer finds no checkpoint.

The gate is a listener on the duration event orbax records in its background thread between
writing the files and renaming the step's folder into place (``jax.monitoring``). The test
checks that the gate was met, so that a renamed event fails it instead of leaving it
vacuous.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcoll import dp
from jaxcoll.dp.checkpoint.checkpointer import COMMIT_STEPS
from tests.helpers import mesh_1d

# Recorded by orbax's background save thread once the files are written, before the
# temporary folder is renamed to the step's final name (the commit).
COMMIT_EVENT = "/jax/checkpoint/write/async/commit_duration_sec"
GATE_S = 30.0  # the most a gated commit waits if nothing opens the gate


class Gate:
    """Holds orbax's background commit until the armed thread joins a thread."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.met = threading.Event()  # the background thread reached the gate
        self.armed: threading.Thread | None = None
        self.opened_by_join = False

    def listener(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == COMMIT_EVENT and threading.current_thread() is not self.armed:
            self.met.set()
            self.open.wait(GATE_S)

    def joined(self) -> None:
        if threading.current_thread() is self.armed and not self.open.is_set():
            self.opened_by_join = True
            self.open.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    join = threading.Thread.join

    def gated_join(thread: threading.Thread, timeout: float | None = None) -> None:
        g.joined()
        join(thread, timeout)

    monkeypatch.setattr(threading.Thread, "join", gated_join)
    jax.monitoring.register_event_duration_secs_listener(g.listener)
    try:
        yield g
    finally:
        g.open.set()  # a commit left gated (a wait that did not wait) finishes
        jax.monitoring.unregister_event_duration_listener(g.listener)


def _loss(w, batch, rng):
    return jnp.mean((batch["x"] @ w["w"] - batch["y"]) ** 2), {}


def _state(step: int) -> dp.TrainState:
    trainer = dp.Trainer(_loss, optax.adam(0.1), mesh=mesh_1d(8, "data"))
    w = jnp.arange(24, dtype=jnp.float32).reshape(8, 3) / 7.0
    state = trainer.init({"w": w}, jax.random.key(3))
    return state.replace(step=jnp.asarray(step, jnp.int32))


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def _assert_committed(directory: str, step: int, state: dp.TrainState) -> None:
    """``step`` is on disk under its final name, nothing half-written, and reads back."""
    names = sorted(os.listdir(directory))
    assert str(step) in names and not any("tmp" in n for n in names), (
        f"the save of step {step} is not committed when the wait returns: {names}"
    )
    other = dp.Checkpointer(directory, every=None)  # a new manager: it sees only the disk
    try:
        assert other.manager.all_steps() == [step]
        template = state.replace(step=jnp.asarray(0, jnp.int32))
        restored = other.restore_latest(template)
        assert int(restored.step) == step
        assert _leaves_equal(restored, state)
    finally:
        other.close()


@pytest.mark.parametrize("how", ["wait", "at_step"])
def test_the_wait_returns_a_committed_checkpoint(tmp_path, gate, how):
    step = 6
    state = _state(step)
    ckpt = dp.Checkpointer(tmp_path / "c", every=None)
    try:
        ckpt.save(state)
        gate.armed = threading.current_thread()  # from here, joining a thread is waiting
        assert ckpt.committed is None
        if how == "wait":
            ckpt.wait()
        else:
            ckpt.at_step(step + 1)  # one step later: not waited for yet
            assert ckpt.committed is None and not gate.opened_by_join
            ckpt.at_step(step + COMMIT_STEPS)
        _assert_committed(ckpt.directory, step, state)
        assert ckpt.committed == step
        assert gate.met.is_set(), f"orbax's commit never reached {COMMIT_EVENT!r}: no gate"
        assert gate.opened_by_join
    finally:
        gate.open.set()
        ckpt.close()
