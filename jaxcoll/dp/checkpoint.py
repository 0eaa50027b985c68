"""Checkpoints of the whole TrainState with orbax-checkpoint."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from .state import TrainState


class Checkpointer:
    """Save and restore a :class:`TrainState` (params, optimizer state, model state, step,
    rng; the step is also the data position) under one directory, keyed by step.

    Args:
        directory: where checkpoints live (created if missing).
        every: :meth:`Trainer.fit` saves when ``step % every == 0``; the manager keeps the
            last ``max_to_keep``.
        max_to_keep: how many checkpoints to keep.

    Example::

        >>> ckpt = Checkpointer("/tmp/run1", every=50)
        >>> ckpt.save(state); ckpt.close()
        >>> state = Checkpointer("/tmp/run1").restore_latest(template_state)
    """

    def __init__(self, directory: str, *, every: int = 100, max_to_keep: int = 2) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Checkpointer: every={every!r} must be a positive int (steps "
                             f"between saves).")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state: TrainState) -> None:
        """Save ``state`` under its step (a no-op if that step is saved already)."""
        step = int(jax.device_get(state.step))
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.StandardSave(state))

    def restore_latest(self, template: TrainState) -> TrainState:
        """The latest saved state, placed like ``template``; ``template`` if none is saved."""
        step = self.manager.latest_step()
        if step is None:
            return template
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
