"""Checkpoints of the whole TrainState with orbax-checkpoint."""

from __future__ import annotations

import os
import warnings

import jax
import orbax.checkpoint as ocp

from .state import TrainState


def check_directory(api: str, argname: str, path: str | os.PathLike) -> str:
    """``path`` as an absolute directory that exists (created if missing) and is writable.

    Checked before any training, so a bad path fails at once instead of at the first save.
    """
    try:
        path = os.path.abspath(os.fspath(path))
    except TypeError:
        raise TypeError(f"{api}: {argname} must be a path (str or os.PathLike), got "
                        f"{type(path).__name__} instead.") from None
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{api}: {argname}={path!r} is a file, not a directory; pass a "
                         f"directory for the checkpoints (it is created if missing).")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{api}: {argname}={path!r} cannot be created ({e.strerror}: "
                         f"{e.filename}); pass a directory you can write to.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{api}: {argname}={path!r} is not writable; pass a directory you "
                         f"can write to.")
    return path


class Checkpointer:
    """Save and restore a :class:`TrainState` (params, optimizer state, model state, step,
    rng, extra; the step is also the data position) under one directory, keyed by step.

    Args:
        directory: where checkpoints live (created if missing).
        every: :meth:`Trainer.fit` saves when ``step % every == 0``; the manager keeps the
            last ``max_to_keep``.
        max_to_keep: how many checkpoints to keep.

    A checkpoint that cannot be read back (a file truncated, emptied or deleted, e.g. by a
    crash during the write or a full disk) is skipped on restore with a warning naming its
    step, and the newest good one is restored; a later save of the same step replaces it.

    Example::

        >>> ckpt = Checkpointer("/tmp/run1", every=50)
        >>> ckpt.save(state); ckpt.close()
        >>> state = Checkpointer("/tmp/run1").restore_latest(template_state)
    """

    def __init__(self, directory: str | os.PathLike, *, every: int = 100,
                 max_to_keep: int = 2) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Checkpointer: every={every!r} must be a positive int (steps "
                             f"between saves).")
        self.directory = check_directory("Checkpointer", "directory", directory)
        self.options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=self.options)
        self.damaged: set[int] = set()

    def save(self, state: TrainState) -> None:
        """Save ``state`` under its step (a no-op if that step is saved already and good)."""
        step = int(jax.device_get(state.step))
        if step in self.damaged:
            self.manager.delete(step)
            self.damaged.discard(step)
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.StandardSave(state))

    def restore_latest(self, template: TrainState) -> TrainState:
        """The newest state that reads back, placed like ``template``; ``template`` if none
        is saved.

        Raises:
            RuntimeError: checkpoints exist but none can be restored into ``template``
                (each one's error is listed: damaged files, or a model that changed).
        """
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template)
        errors = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
            except Exception as e:  # any failure to read it back: damaged (or a new model)
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                errors.append(f"step {step}: {reason}")
                self.damaged.add(step)
                # A fresh manager for the next try: a failed restore can leave the manager
                # with wrong ideas about the checkpoints' layout.
                self.manager.close()
                self.manager = ocp.CheckpointManager(self.directory, options=self.options)
                warnings.warn(f"Checkpointer: the checkpoint of step {step} in "
                              f"{self.directory} cannot be restored ({reason}); skipping it "
                              f"for an older one.", RuntimeWarning, stacklevel=2)
        if errors:
            raise RuntimeError(
                f"Checkpointer: no checkpoint in {self.directory} can be restored into this "
                f"state:\n  " + "\n  ".join(errors) + "\nIf the model or optimizer changed, "
                "start in a new directory; otherwise remove the damaged steps.")
        return template

    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
