"""Checkpoints of the whole TrainState with orbax-checkpoint."""

from __future__ import annotations

import numbers
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
        raise TypeError(
            f"{api}: {argname} must be a path (str or os.PathLike), got "
            f"{type(path).__name__} instead."
        ) from None
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"{api}: {argname}={path!r} is a file, not a directory; pass a "
            f"directory for the checkpoints (it is created if missing)."
        )
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{api}: {argname}={path!r} cannot be created ({e.strerror}: "
            f"{e.filename}); pass a directory you can write to."
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"{api}: {argname}={path!r} is not writable; pass a directory you can write to."
        )
    return path


class Checkpointer:
    """Save and restore a :class:`TrainState` (params, optimizer state, model state, step,
    rng, extra, hook state; the step is also the data position) under one directory, keyed
    by step.

    ``trainer.fit(state, data, steps=..., checkpoint=Checkpointer(directory, every=100))``
    restores the newest checkpoint there first, saves every ``every`` steps and at the end.
    Saving is collective in a multi-process job: every process builds its Checkpointer on
    the same directory (a filesystem they all see) and calls :meth:`save`, as ``fit`` does.

    Args:
        directory: where checkpoints live (checked at once: created if missing, and it must
            be a writable directory).
        every: steps between saves in :meth:`Trainer.fit` (it saves when
            ``step % every == 0``).
        max_to_keep: how many checkpoints to keep (the newest).

    A checkpoint that cannot be read back (a file truncated, emptied or deleted, e.g. by a
    crash during the write or a full disk) is skipped on restore with a warning naming its
    step, and the newest good one is restored; a later save of the same step replaces it.
    :meth:`close` waits for pending saves and releases the orbax manager (``fit`` closes it
    when it ends); a closed Checkpointer opens a new manager when it is used again.

    Example::

        >>> ckpt = Checkpointer("/tmp/run1", every=50)
        >>> state, history = trainer.fit(state, data, steps=1000, checkpoint=ckpt)
        >>> state = Checkpointer("/tmp/run1").restore_latest(template_state)
    """

    def __init__(
        self, directory: str | os.PathLike, *, every: int = 100, max_to_keep: int = 2
    ) -> None:
        for name, value, what in (
            ("every", every, "steps between saves"),
            ("max_to_keep", max_to_keep, "checkpoints kept"),
        ):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(
                    f"Checkpointer: {name} must be an int ({what}), got {value!r} "
                    f"of type {type(value).__name__} instead."
                )
            if value < 1:
                raise ValueError(f"Checkpointer: {name}={value!r} must be a positive int ({what}).")
        self.directory = check_directory("Checkpointer", "directory", directory)
        self.every = int(every)
        self.options = ocp.CheckpointManagerOptions(max_to_keep=int(max_to_keep), create=True)
        self._manager: ocp.CheckpointManager | None = None
        self.damaged: set[int] = set()

    @property
    def manager(self) -> ocp.CheckpointManager:
        """The orbax ``CheckpointManager`` (opened on first use, again after :meth:`close`)."""
        if self._manager is None:
            self._manager = ocp.CheckpointManager(self.directory, options=self.options)
        return self._manager

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, every={self.every})"

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
                self._manager = None
                warnings.warn(
                    f"Checkpointer: the checkpoint of step {step} in "
                    f"{self.directory} cannot be restored ({reason}); skipping it "
                    f"for an older one.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if errors:
            raise RuntimeError(
                f"Checkpointer: no checkpoint in {self.directory} can be restored into this "
                f"state:\n  " + "\n  ".join(errors) + "\nIf the model or optimizer changed, "
                "start in a new directory; otherwise remove the damaged steps."
            )
        return template

    def close(self) -> None:
        """Wait for pending saves and release the manager (a later use opens a new one)."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None
