"""Checkpoints of the whole TrainState with orbax-checkpoint, restored into any layout.

A checkpoint holds every leaf as one global array, whatever the strategy and the device
count that wrote it; :meth:`Checkpointer.restore_latest` reads it into the shardings of the
template it is given (torch DCP's resharding). Saving and restoring are collective in a
multi-process job: every process first meets the others in ``jax.distributed``'s key-value
store (:func:`rendezvous`), so a call made on one process only fails at once with an error
that says so, instead of inside orbax's collectives.
"""

from __future__ import annotations

import numbers
import os
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..._core.checks import check_count
from ..._watch import process
from ..checks import as_path
from ..state import TrainState
from ._commit import Barriers, Beacon, CommitAbandoned
from ._match import check_template, comm_mismatch
from ._rendezvous import rendezvous

COMMIT_STEPS = 2
"""``fit`` waits for a save's commit once the step this many steps after the save is
dispatched (:meth:`Checkpointer.at_step`): a save is a checkpoint on disk before the process
goes further, so a process lost later cannot take it with it."""


def check_directory(api: str, argname: str, path: str | os.PathLike) -> str:
    """``path`` as an absolute directory that exists (created if missing) and is writable.

    Checked before any training, so a bad path fails at once instead of at the first save.
    """
    path = as_path(api, argname, path)
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
    With ``every=None`` it saves only when a callback asks (``dp.Action.SAVE``, e.g.
    :class:`~jaxcoll.dp.SaveBest`: the best state so far) and on a preemption, never
    periodically nor at the end; the newest checkpoint, which ``fit`` restores, is then the
    last one asked for.
    Saving is collective in a multi-process job: every process builds its Checkpointer on
    the same directory (a filesystem they all see) and calls :meth:`save`, as ``fit`` does.

    Args:
        directory: where checkpoints live (checked at once: created if missing, and it must
            be a writable directory).
        every: steps between saves in :meth:`Trainer.fit` (it saves when
            ``step % every == 0``, and at the end); None: only when a callback returns
            ``dp.Action.SAVE`` (and on SIGTERM), not at the end.
        max_to_keep: how many checkpoints to keep (the newest).
        rendezvous_timeout: in a multi-process job, the seconds :meth:`save` and
            :meth:`restore_latest` wait for every other process to make the same call
            before they raise (at once when a peer has exited or failed); raise it if your
            processes reach a save further apart than that.
        enable_async_checkpointing: True (orbax's default, and torch DCP's ``async_save``):
            :meth:`save` returns once the state is copied to host memory, and the write
            and the commit go on behind the next steps; False: :meth:`save` returns once
            the step is committed on disk.

    Asynchronous saving: what blocks the step that saves is the copy of the state from the
    devices to host memory (and, in a multi-process job, a few meetings of the processes);
    the files are written, and the step committed (every process's shards written, then
    the step's folder renamed into place by process 0), in orbax's background thread while
    training goes on. ``fit`` waits for that commit when it dispatches the step
    :data:`COMMIT_STEPS` (2) steps after the save (:meth:`at_step`), so each save is a
    checkpoint on disk within two steps, and always before the next save; :meth:`wait`
    waits for it at any time, and ``enable_async_checkpointing=False`` at every save. A save
    whose commit cannot complete because a process is gone (it ended, failed, or gave no
    sign of life; see :mod:`jaxcoll.dp.checkpoint._commit`) ends the processes left with a
    line naming it and the newest committed step, exit code 1, instead of an abort inside
    orbax or JAX.

    Saved: the whole :class:`TrainState` (params, optimizer state, model state, step, rng,
    extra, hook state), each leaf as one global array: a checkpoint written under any
    strategy (``dp.sync.DDP``, ``ZeRO1``, ``FSDP``) and any device or process count restores
    under any other; :meth:`restore_latest` places every leaf as its template is placed. The
    one exception is the communication hook's state (``state.comm_state``, e.g. PowerSGD's
    error feedback), which is per rank: it restores only into the same hook on the same
    number of ranks; otherwise it starts fresh from the template, with a warning.

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
        self,
        directory: str | os.PathLike,
        *,
        every: int | None = 100,
        max_to_keep: int = 2,
        rendezvous_timeout: float = 60.0,
        enable_async_checkpointing: bool = True,
    ) -> None:
        if not isinstance(enable_async_checkpointing, bool):
            raise TypeError(
                f"Checkpointer: enable_async_checkpointing must be True or False, got "
                f"{enable_async_checkpointing!r} of type "
                f"{type(enable_async_checkpointing).__name__} instead."
            )
        for name, value, what in (
            ("every", every, "steps between saves"),
            ("max_to_keep", max_to_keep, "checkpoints kept"),
        ):
            if name == "every" and value is None:  # saves only when a callback asks
                continue
            check_count("Checkpointer", name, value, 1, what)
        t = rendezvous_timeout
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise TypeError(
                f"Checkpointer: rendezvous_timeout must be a number of seconds, got {t!r} "
                f"of type {type(t).__name__} instead."
            )
        if not t > 0:
            raise ValueError(
                f"Checkpointer: rendezvous_timeout={t!r} must be a positive number of seconds."
            )
        self.rendezvous_timeout: float = float(t)
        self.directory: str = check_directory("Checkpointer", "directory", directory)
        self.every: int | None = None if every is None else int(every)
        self.enable_async_checkpointing: bool = enable_async_checkpointing
        self._barriers: Barriers = Barriers(self.directory)
        self._beacon: Beacon = Beacon()
        # Always orbax's asynchronous checkpointer: a synchronous save is this one waited for
        # (wait), so that a lost peer is met by jaxcoll's barriers either way.
        self.options: Any = ocp.CheckpointManagerOptions(
            max_to_keep=int(max_to_keep),
            create=True,
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(barrier_sync_fn=self._barriers),
        )
        self._manager: ocp.CheckpointManager | None = None
        self._pending: int | None = None  # the step whose commit is under way
        self.committed: int | None = None
        """The newest step this Checkpointer saved and saw committed."""
        self.damaged: set[int] = set()

    @property
    def manager(self) -> ocp.CheckpointManager:
        """The orbax ``CheckpointManager`` (opened on first use, again after :meth:`close`)."""
        if self._manager is None:
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=self.options,
                item_handlers=_handler(),
            )
        return self._manager

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, every={self.every})"

    def wait(self) -> None:
        """Wait until the last :meth:`save` is committed: a checkpoint on disk, which
        :meth:`restore_latest` finds (torch DCP's ``async_save(...).result()``, orbax's
        ``wait_until_finished``). Nothing to do when no save is under way.

        Returns within a few seconds of a peer's loss too: in a multi-process job, a commit
        that cannot complete because a process is gone ends this process with a line naming
        that process and the newest committed step, exit code 1 (through
        :func:`jaxcoll._watch.process.leave`, so that the others leave as well); in one
        process, its error is raised as RuntimeError.
        """
        step, self._pending = self._pending, None
        if step is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the commit failed: say which and why
            self._commit_failed(step, e)
        finally:
            self._beacon.stop()
        self.committed = step

    def at_step(self, step: int) -> None:
        """Called by :meth:`Trainer.fit` once step ``step`` is dispatched (a loop of your own
        may do the same): :meth:`wait` for a save made :data:`COMMIT_STEPS` or more steps
        before, so that every save is committed within two steps."""
        if self._pending is not None and step - self._pending >= COMMIT_STEPS:
            self.wait()

    def _commit_failed(self, step: int, e: BaseException) -> None:
        """End the process (several) or raise (one) for a save of ``step`` that failed."""
        why = self._barriers.abandoned
        cause = (
            f"{why}, so its part of the save is not written"
            if why is not None
            else f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        )
        last = (
            f"the newest committed one is step {self.committed}"
            if self.committed is not None
            else "no step was committed by this run"
        )
        me, n = process.me()
        line = (
            f"Checkpointer: the save of step {step} in {self.directory} cannot be committed: "
            f"{cause}. Step {step} is not a checkpoint; {last}, where a restart resumes."
        )
        if process.client() is None or n < 2:
            raise RuntimeError(line) from e
        process.leave(
            1,
            f"jaxcoll: process {me} of {n} stops: {line} Exiting with code 1.",
            reason=line,
        )

    def save(self, state: TrainState) -> None:
        """Save ``state`` under its step (a no-op if that step is saved already and good).

        Collective in a multi-process job: every process calls it with the same state, as
        :meth:`Trainer.fit` does; each writes its own shards. A call on some processes only
        (``if jax.process_index() == 0: ckpt.save(state)``, as one writes
        ``torch.save`` on the master rank) raises RuntimeError on the processes that made it,
        within ``rendezvous_timeout`` seconds, before any file is written.

        Asynchronous by default: it returns once the state is in host memory, and the step
        is committed in the background (see the class's notes; :meth:`wait` waits for it);
        it first waits for the previous save's commit.
        """
        step = int(jax.device_get(state.step))
        seq = rendezvous(
            "Checkpointer.save",
            f"save step {step}",
            self.directory,
            self.rendezvous_timeout,
            fix="call ckpt.save(state) on every process (drop the `if process_index == 0` "
            "guard; orbax writes each shard once)",
        )
        self.wait()  # the previous save is committed before this one starts
        if step in self.damaged:
            self.manager.delete(step)
            self.damaged.discard(step)
        if step in self.manager.all_steps():
            return
        self._barriers.begin(seq)
        self._beacon.start()
        self._pending = step
        try:
            self.manager.save(step, args=ocp.args.PyTreeSave(state))
        except CommitAbandoned as e:  # a peer lost at one of the save's own meetings
            self._pending = None
            self._beacon.stop()
            self._commit_failed(step, e)
        if not self.enable_async_checkpointing:
            self.wait()

    def restore_latest(self, template: TrainState) -> TrainState:
        """The newest state that reads back, placed like ``template``; ``template`` if none
        is saved.

        Each leaf is read into the sharding of ``template``'s leaf, so a checkpoint written
        under another strategy, device count or number of processes restores here: build
        ``template`` with the Trainer that goes on (``trainer.init(params, rng)``). The hook
        state (``comm_state``) is restored only when the checkpoint's has the template's
        structure, shapes and dtypes (the same hook on the same number of ranks); otherwise
        the template's fresh one is kept and a RuntimeWarning says what was reset and why.
        Collective in a multi-process job, like :meth:`save`.

        The template is checked against the saved metadata first: a template that does not
        match (the params instead of the whole state, another model width, another
        optimizer) raises at once, naming the leaf and its saved and given shapes and dtypes;
        the checkpoints are left as they are. Only a step whose files fail to read
        (truncated, emptied, deleted) is skipped, with a warning, for an older one.

        Raises:
            TypeError: ``template`` is not a :class:`TrainState` (e.g. the params alone).
            ValueError: ``template``'s structure, shapes or dtypes differ from the newest
                checkpoint that reads back (a model or optimizer that changed).
            RuntimeError: checkpoints exist but none reads back (each one's error is
                listed, with how to check it); or, in a multi-process job, another process
                did not call it too.
        """
        rendezvous(
            "Checkpointer.restore_latest",
            "restore_latest",
            self.directory,
            self.rendezvous_timeout,
            fix="call it on every process (Trainer.fit does, with checkpoint=...)",
        )
        self.wait()
        errors: list[str] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                saved = self._saved_tree(step)
            except Exception as e:  # its metadata does not read: damaged
                self._skip_damaged(step, e, errors)
                continue
            # A template that does not match raises here, never counted as damage.
            check_template("Checkpointer.restore_latest", template, saved, step, self.directory)
            try:
                return self._restore(step, template, saved)
            except Exception as e:  # the metadata reads, the arrays do not: damaged
                self._skip_damaged(step, e, errors)
        if errors:
            first = errors[0].split(":", 1)[0].split()[1]
            raise RuntimeError(
                f"Checkpointer.restore_latest: no checkpoint in {self.directory} reads back:"
                f"\n  " + "\n  ".join(errors) + "\nThe template matches what each one's "
                f"metadata holds; their files fail to read (truncated, emptied or deleted, "
                f"e.g. by a crash or a full disk during the write). Check one first: "
                f"dp.Checkpointer({self.directory!r}).restore({first}, template), with the "
                f"template you train with, reads that step alone and raises its full error; "
                f"if it fails the same way, remove that step's folder "
                f"({os.path.join(self.directory, first)}) or start in a new directory."
            )
        return template

    def restore(self, step: int, template: TrainState) -> TrainState:
        """The checkpoint of ``step`` exactly, placed like ``template`` (no fallback to an
        older step): to check one step, e.g. one that :meth:`restore_latest` skipped.

        Collective in a multi-process job, like :meth:`save`.

        Raises:
            TypeError, ValueError: ``template`` does not match the checkpoint (see
                :meth:`restore_latest`).
            ValueError: no checkpoint of ``step`` is in the directory.
            Exception: orbax's own error when the step's files fail to read.
        """
        rendezvous(
            "Checkpointer.restore",
            f"restore step {step}",
            self.directory,
            self.rendezvous_timeout,
            fix="call it on every process",
        )
        self.wait()
        steps = self.manager.all_steps()
        if step not in steps:
            raise ValueError(
                f"Checkpointer.restore: step={step!r} has no checkpoint in {self.directory} "
                f"(saved: {sorted(steps) or 'none'}); pass one of those."
            )
        saved = self._saved_tree(step)
        check_template("Checkpointer.restore", template, saved, step, self.directory)
        return self._restore(step, template, saved)

    def _saved_tree(self, step: int) -> Any:
        """The saved tree of ``step`` with orbax's metadata (shape, dtype) at its leaves."""
        meta = self.manager.item_metadata(step)
        saved = getattr(meta, "tree", meta)
        if not isinstance(saved, dict):
            raise ValueError(f"no tree in the metadata of step {step} (got {type(saved).__name__})")
        return saved

    def _skip_damaged(self, step: int, e: Exception, errors: list[str]) -> None:
        """Record ``step`` as damaged (a later save of it replaces it) and warn."""
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        errors.append(f"step {step}: {reason}")
        self.damaged.add(step)
        # A fresh manager for the next try: a failed restore can leave the manager with wrong
        # ideas about the checkpoints' layout.
        self.manager.close()
        self._manager = None
        warnings.warn(
            f"Checkpointer: the checkpoint of step {step} in {self.directory} cannot be "
            f"restored (its files fail to read: {reason}); skipping it for an older one.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _restore(self, step: int, template: TrainState, saved: Any) -> TrainState:
        """Step ``step`` read into ``template``'s shardings; its hook state kept only if it
        fits the template's (see :meth:`restore_latest`). ``saved``: its metadata tree."""
        target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template)
        saved_comm = saved.get("comm_state", {})
        why = comm_mismatch(saved_comm, template.comm_state)
        if why is None:
            return self.manager.restore(step, args=_restore_args(target))
        # The hook state is not read at all: a placeholder for every saved leaf of it, which
        # orbax's PyTree handler skips.
        target = target.replace(
            comm_state=jax.tree_util.tree_map(lambda _: ocp.PLACEHOLDER, saved_comm)
        )
        restored = self.manager.restore(step, args=_restore_args(target))
        warnings.warn(
            f"Checkpointer.restore_latest: the communication hook's state (state.comm_state) "
            f"saved at step {step} in {self.directory} is not restored: it is per rank and "
            f"{why}. Everything else is restored; the hook state starts fresh from the "
            f"template's (for PowerSGD: zero error feedback and new factors, as at step 0).",
            RuntimeWarning,
            stacklevel=3,
        )
        return restored.replace(comm_state=template.comm_state)

    def close(self) -> None:
        """Wait for pending saves (:meth:`wait`) and release the manager (a later use opens
        a new one)."""
        self.wait()
        if self._manager is not None:
            self._manager.close()
            self._manager = None


def _handler() -> ocp.PyTreeCheckpointHandler:
    """orbax's PyTree handler with its default type handlers but for ``jax.Array``'s, which is
    given two options:

    * ``use_replica_parallel=False``, orbax's default on GPUs: on CPUs replica-parallel saving
      slices each replicated array in eager ops, one per replica, before the save returns
      (the save's blocking part: 31-103 ms -> 5-25 ms for examples/gpt.py's state);
    * no array metadata store: every process but the first waits for the first to create its
      folder by polling every 250 ms, which made each save of a 2-process job 220 ms longer
      (the write barrier's wait). The metadata it keeps (each process's write shapes) is not
      needed to restore, into any layout.
    """
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
        (bytes, th.ScalarHandler()),
        (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, th.ArrayHandler(use_replica_parallel=False, array_metadata_store=None)),
        (str, th.StringHandler()),
        (type(ocp.PLACEHOLDER), th.get_type_handler(type(ocp.PLACEHOLDER))),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _restore_args(target: Any) -> Any:
    """The orbax arguments that read a step into ``target`` (placeholders skipped)."""
    return ocp.args.PyTreeRestore(
        item=target, restore_args=jax.tree_util.tree_map(_restore_arg, target)
    )


def _restore_arg(x: Any) -> Any:
    """orbax's restore argument for a leaf of a target: its sharding, shape and dtype."""
    if not isinstance(x, jax.ShapeDtypeStruct):
        return x  # a placeholder
    if x.sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype)
    return ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype)
