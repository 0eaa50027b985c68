"""dp.Survivor: a Trainer that goes on without a lost data replica, with no restart.

Each data replica (an index of the layout's ``replicate`` axis) holds the whole training state
over its own devices and is made of whole processes (HSDP ``dp.Layout(replicate=2, shard=4)``
on 2 processes x 4 devices: replica = process). When a process dies, the survivors' next step
fails in a collective with it (``jax.errors.JaxRuntimeError``, after XLA's collective
timeout); :class:`Survivor` then asks :func:`jaxcoll.distributed.live_devices` which devices
are alive, keeps the replicas that are whole, builds a mesh of them (the ``replicate`` axis
shorter, every kept device at its old position inside its replica) and a Trainer for it,
places the state from its own replica's copy (the step's input, kept because nothing is
donated) and runs the *same* step on the *same* global batch again. The step count goes on;
nothing is skipped or trained twice.

What it costs, measured: see :class:`Survivor`. What it asks of the job and layout is checked
in ``_checks.py``; the state and batches are moved onto a new mesh by ``_moves.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh

from ..._core.live import live_devices
from ..._core.roles import Role
from ..._core.typing import PyTree
from ..adapters import Model
from ..extra import Extra
from ..layout import Layout
from ..state import TrainState
from ..step.loss import LossFn
from ..sync import Strategy
from ..sync.semisync import DiLoCo
from ..trainer import Trainer
from ._checks import _check_job, _named, _unwatched, _whole_processes
from ._moves import (
    _from_first_replica,
    _global,
    _local_int,
    _placed,
    _publish,
    _published,
    _zeros_on,
)

__all__ = ["Recovery", "Survivor"]


class Recovery(NamedTuple):
    """One loss a :class:`Survivor` went on from (``survivor.recoveries``)."""

    step: int
    """The step that failed and was run again on the smaller mesh."""
    processes: tuple[int, ...]
    """The processes whose replicas were dropped (the dead ones and their replicas' others)."""
    replicas: int
    """Data replicas left."""
    seconds: float
    """From the failed step's error to the smaller mesh's Trainer and state being ready."""


class Survivor:
    """A :class:`~jaxcoll.dp.Trainer` that loses data replicas without a restart.

    Roughly::

        def step(state, batch):                 # batch: the GLOBAL batch, or batch(step)
            try:
                return trainer.step(state, batch)            # donate=False: state stays
            except jax.errors.JaxRuntimeError:               # a collective with a dead peer
                live = dist.live_devices(trainer.mesh.devices.flat)
                mesh = Mesh(<the replicas whose devices are all live>, trainer.mesh.axis_names)
                trainer = Trainer(..., mesh=mesh)            # replicate axis shorter
                state = <state placed on mesh from this process's replica's copy>
                return trainer.step(state, batch)            # the same step, the same batch

    The job must be started with recoverability: ``JAXCOLL_RECOVERABLE=1`` for
    :func:`jaxcoll.init` (or ``jax.config.update("jax_enable_recoverability", True)`` before
    joining) in every process, and, on CPU, a finite ``--xla_cpu_collective_timeout_seconds``
    in ``XLA_FLAGS`` (read once per process, so the launcher sets it; ``jaxcoll-run``'s week
    makes the survivors wait for the dead peer for ever: refused here). Process 0 hosts the
    coordination service: if it dies, every process ends.

    **Batches.** ``step`` takes the global batch (NumPy, whole on every process) or a function
    ``batch(step) -> global batch`` of the step number: after a loss the survivors feed the
    dead replicas' rows too, so each process must be able to produce every row of a step.
    Each process places its devices' rows of the host batch itself
    (``jax.make_array_from_callback``; ``jax.device_put`` would check the batch across the
    processes with a collective a replacement cannot join). A pipeline that reads only its
    own rows (:class:`~jaxcoll.dp.TokenBatches`) is not supported: re-split it at the
    current step over the new mesh yourself (``survivor.trainer.batch_sharding``) and pass
    global ``jax.Array`` s placed so, or host batches.

    **Equal to one device.** The steps equal a single device stepping the global batches
    (up to float summation order) for a loss without randomness: the ranks' rng streams are
    folded by rank, and the ranks change with the mesh. The state must be replicated over the
    ``replicate`` axis (DDP, ZeRO-1, FSDP over ``shard``, HSDP: every strategy but per-rank
    hook state, e.g. PowerSGD's error feedback, which a lost replica takes with it: refused at
    the loss, naming the leaf).

    **Costs.** Each step is waited for (a failure must show at its own step, with its input
    still held), the step donates nothing (the state's memory twice), and this process's
    collective watchdog and flight recorder are off in a multi-process job (the watchdog's
    failed-device check ends a process in which some devices' share of a step has failed while
    the others' still wait, as a survivor's devices fail one by one at a loss; the XLA
    collective timeout bounds a stuck step instead). A loss costs the failed step's wait (at
    once when the dead process's connections reset; the collective timeout when the survivor
    waits on a live peer that waits on the dead one), the heartbeat timeout at most for the
    coordination service to agree on the live devices, then one compile. Measured (jax 0.10.2,
    XLA:CPU, gloo, heartbeat 3 s, collective timeout 10 s, 2 shared cores,
    ``tests/multihost/test_replica_loss.py``): the lost step completed on the survivor 4.2-5.4 s
    after the SIGKILL with 2 processes x 4 devices (about 2 s of it agreeing on the live
    devices), 12.0-14.6 s with 4 x 2 (the collective timeout, then the same). A restart from a
    checkpoint instead (``jaxcoll-run --max-restarts 1``, the HSDP job of
    ``tests/multihost/workers/train.py``, 12 steps, a checkpoint every 4, killed at step 6) took
    21 s longer than the job without a kill (43.2 s against 21.8 s).

    Args:
        loss_fn: as :class:`~jaxcoll.dp.Trainer`'s.
        optimizer: as :class:`~jaxcoll.dp.Trainer`'s.
        layout: a layout given by degrees with a ``replicate`` degree above 1 (or -1), whose
            replicas are whole processes: ``dp.Layout(replicate=2, shard=4)`` on 2 x 4.
        sync: as :class:`~jaxcoll.dp.Trainer`'s (default: the layout's).
        accum_steps: as :class:`~jaxcoll.dp.Trainer`'s.
        extra: as :class:`~jaxcoll.dp.Trainer`'s.
        skip_nonfinite: as :class:`~jaxcoll.dp.Trainer`'s.
        timeout: seconds :func:`~jaxcoll.distributed.live_devices` may wait for the live
            processes to agree (default 60; more than the heartbeat timeout).
        rejoin: admit replicas that come back: while the mesh is smaller than the first,
            each step first asks :func:`~jaxcoll.distributed.live_devices` whether a
            replacement process waits in :meth:`join` (a few ms; once one has joined the job
            this step waits for it to ask, at most ``timeout``), and if its replica is whole
            again, grows the mesh and sends it the state.

    Attributes:
        trainer: the Trainer of the current mesh (a new one after each loss).
        recoveries: a :class:`~jaxcoll.dp.survivor.Recovery` per loss gone on from.

    **Replacements.** With ``rejoin=True`` a process started again with a dead one's id
    calls :meth:`join` instead of :meth:`init` and gets the job's state at the survivors' next
    step boundary; from there it calls :meth:`step` like the others. Measured as above
    (2 x 4): the replacement had joined the job 3.3-3.8 s after it was started and its first
    step was done 5.7-6.5 s after (imports, joining, the state's transfer and a compile),
    its losses and final params those of one device.

    Example (every process of ``JAXCOLL_RECOVERABLE=1``, 2 processes x 4 devices)::

        >>> survivor = dp.Survivor(loss_fn, optax.sgd(0.1), layout=dp.Layout(replicate=2, shard=4))
        >>> state = survivor.init(params, jax.random.key(0))
        >>> for i in range(100):
        ...     state, metrics = survivor.step(state, global_batch)   # same batch everywhere
    """

    def __init__(
        self,
        loss_fn: LossFn | Model,
        optimizer: optax.GradientTransformation | optax.MultiSteps,
        *,
        layout: Layout,
        sync: Strategy | None = None,
        accum_steps: int = 1,
        extra: Extra | None = None,
        skip_nonfinite: bool = False,
        timeout: float = 60.0,
        rejoin: bool = False,
    ) -> None:
        api = "dp.Survivor"
        _check_job(api)
        if not isinstance(layout, Layout) or not layout.by_degree:
            raise TypeError(
                f"{api}: layout must be a dp.Layout given by degrees (the Survivor builds its "
                f"meshes), e.g. dp.Layout(replicate=2, shard=4), got {layout!r}."
            )
        if Role.REPLICATE.value not in layout.make_mesh().axis_names:
            raise ValueError(
                f"{api}: layout={layout!r} has no replicate axis; the Survivor drops whole "
                f"data replicas: give replicate= a degree above 1, e.g. "
                f"dp.Layout(replicate=2, shard=4)."
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"{api}: timeout={timeout!r} must be a positive number of seconds.")
        if isinstance(sync, DiLoCo):
            raise TypeError(
                f"{api}: sync={type(sync).__name__}(...) keeps one state per replica, which a "
                f"Survivor cannot drop yet; train it with dp.Trainer and survive a lost process "
                f"through a restart (jaxcoll-run --max-restarts), or pass sync=dp.sync.DDP() or "
                f"dp.sync.FSDP()."
            )
        self._options: dict[str, Any] = dict(
            sync=sync, accum_steps=accum_steps, extra=extra, skip_nonfinite=skip_nonfinite
        )
        self._loss_fn, self._optimizer, self.timeout = loss_fn, optimizer, float(timeout)
        self._layout = _named(layout)
        mesh = layout.make_mesh()
        if jax.process_count() > 1:
            _whole_processes(api, mesh)
        self._full, self.rejoin = mesh, bool(rejoin)
        self.trainer: Trainer = self._trainer(mesh)
        self.recoveries: list[Recovery] = []
        if jax.process_count() > 1:  # one process has nothing to lose: leave it watched
            _unwatched()

    @property
    def mesh(self) -> Mesh:
        """The current mesh (``survivor.trainer.mesh``)."""
        return self.trainer.mesh

    def _trainer(self, mesh: Mesh) -> Trainer:
        return Trainer(
            self._loss_fn,
            self._optimizer,
            mesh=mesh,
            layout=self._layout,
            donate=False,
            **self._options,
        )

    def init(self, params: PyTree, rng: jax.Array, **kwargs: Any) -> TrainState:
        """:meth:`Trainer.init <jaxcoll.dp.Trainer.init>` of the current Trainer."""
        return self.trainer.init(params, rng, **kwargs)

    def step(
        self, state: TrainState, batch: PyTree | Callable[[int], PyTree]
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One step on the global batch (or ``batch(step)``), run again on the live replicas
        when a collective fails because a process died.

        Returns:
            The new state and the metrics, both complete (waited for).

        Raises:
            jax.errors.JaxRuntimeError: the step failed and every replica is alive (not a
                lost process: a bug, an out-of-memory), re-raised.
            RuntimeError: this process's replica lost a process: this process is no longer
                in the job's mesh. End it with ``os._exit(0)``: under :func:`jaxcoll.init`
                an uncaught exception is reported to the other processes as a failure, and
                they end too. Process 0 must stay up while the others train: it hosts the
                coordination service.
        """
        if self.rejoin and self.mesh.devices.size < self._full.devices.size:
            state = self._admit(state)
        if callable(batch):
            batch = batch(_local_int(state.step))
        for _ in range(int(self.mesh.shape[Role.REPLICATE.value])):
            try:
                out = self.trainer.step(state, _global(batch, self.trainer.batch_sharding))
                return jax.block_until_ready(out)
            except jax.errors.JaxRuntimeError as error:
                state = self._shrink(state, error)
        out = self.trainer.step(state, _global(batch, self.trainer.batch_sharding))
        return jax.block_until_ready(out)

    def _shrink(self, state: TrainState, error: Exception) -> TrainState:
        """The live replicas' mesh and Trainer; ``state`` placed on it (or ``error`` raised)."""
        t0 = time.monotonic()
        mesh = self.mesh
        axis = mesh.axis_names.index(Role.REPLICATE.value)
        live = {d.id for d in live_devices(list(mesh.devices.flat), timeout=self.timeout)}
        blocks = np.moveaxis(mesh.devices, axis, 0)
        keep = [r for r in range(blocks.shape[0]) if all(d.id in live for d in blocks[r].flat)]
        if len(keep) == blocks.shape[0]:
            raise error
        me = jax.process_index()
        gone = [blocks[r] for r in range(blocks.shape[0]) if r not in keep]
        dropped = sorted({d.process_index for block in gone for d in block.flat})
        if me in dropped:
            raise RuntimeError(
                f"dp.Survivor.step: this process ({me}) is alive but its data replica lost "
                f"process(es) {sorted({p for p in dropped if p != me})}; the others go on "
                f"without it. End this process (process 0 must stay up until they finish: "
                f"it hosts the coordination service)."
            ) from error
        devices = np.moveaxis(blocks[keep], 0, axis)
        new = Mesh(devices, mesh.axis_names, axis_types=(AxisType.Auto,) * devices.ndim)
        state = jax.tree_util.tree_map_with_path(lambda path, x: _placed(path, x, new), state)
        self.trainer = self._trainer(new)
        _publish(new)
        self.recoveries.append(
            Recovery(_local_int(state.step), tuple(dropped), len(keep), time.monotonic() - t0)
        )
        return state

    # ------------------------------------------------------------------------------ rejoin
    def _returning(self, live: set[int], current: np.ndarray) -> list[np.ndarray]:
        """The original replicas whose devices are all live and none in ``current`` (the
        current mesh's replica blocks), each block's devices in a new order (see
        :meth:`join`)."""
        axis = self._full.axis_names.index(Role.REPLICATE.value)
        blocks = np.moveaxis(self._full.devices, axis, 0)
        have = {d.id for d in current.flat}
        back = [
            b
            for b in blocks
            if all(d.id in live for d in b.flat) and not any(d.id in have for d in b.flat)
        ]
        return [np.roll(b.reshape(-1), 1).reshape(b.shape) for b in back]

    def _grown(self, current: np.ndarray, back: list[np.ndarray]) -> Mesh:
        axis = self._full.axis_names.index(Role.REPLICATE.value)
        devices = np.moveaxis(np.concatenate([current, np.stack(back)]), 0, axis)
        return Mesh(devices, self._full.axis_names, axis_types=(AxisType.Auto,) * devices.ndim)

    def _admit(self, state: TrainState) -> TrainState:
        """A survivor's side of :meth:`join`: when replicas came back, the grown mesh, its
        Trainer, and ``state`` on it (sent to the newcomers from the first replica)."""
        mesh = self.mesh
        live = {d.id for d in live_devices(list(self._full.devices.flat), timeout=self.timeout)}
        current = np.moveaxis(mesh.devices, mesh.axis_names.index(Role.REPLICATE.value), 0)
        back = self._returning(live, current)
        if not back:
            return state
        grown = self._grown(current, back)
        state = _from_first_replica(
            jax.tree_util.tree_map_with_path(lambda path, x: _placed(path, x, grown), state),
            grown,
        )
        self.trainer = self._trainer(grown)
        _publish(grown)
        return state

    def join(self, params: PyTree, rng: jax.Array, **kwargs: Any) -> TrainState:
        """In a replacement process (started with a dead process's id): wait until the
        survivors take its replica back in, and return the job's current state on the grown
        mesh. The survivors must run with ``rejoin=True``: each of their steps then first
        asks :func:`~jaxcoll.distributed.live_devices` whether a replica came back (a few
        ms), and admits it (one collective sending the state from their first replica).

        ``params``, ``rng`` and ``kwargs`` are :meth:`init`'s: they give the state's
        structure and placement (their values are replaced by the job's). The returning
        replica's devices take a new order (XLA:CPU keeps one gloo communicator per ordered
        device list, and the dead process's are stale): a process may return once per job.

        Returns:
            The job's state at its current step; go on with :meth:`step`.
        """
        me = jax.process_index()
        axis = self._full.axis_names.index(Role.REPLICATE.value)
        blocks = np.moveaxis(self._full.devices, axis, 0)
        (mine,) = [b for b in blocks if any(d.process_index == me for d in b.flat)]
        order = np.roll(mine.reshape(-1), 1).reshape(mine.shape)
        # The state's structure and placement, on this replica's devices alone.
        alone = self._grown(np.empty((0, *order.shape), object), [order])
        template = self._trainer(alone).init(params, rng, **kwargs)
        until = time.monotonic() + self.timeout
        while True:
            live = {d.id for d in live_devices(list(self._full.devices.flat), timeout=self.timeout)}
            current = _published(self._full, self.timeout)
            back = self._returning(live, current)
            if any(any(d.process_index == me for d in b.flat) for b in back):
                break
            if time.monotonic() > until:
                raise TimeoutError(
                    f"dp.Survivor.join: process {me}'s replica was not whole among the live "
                    f"devices within timeout={self.timeout} s: start every process of it "
                    f"again (or the survivors have finished)."
                )
            time.sleep(0.1)
        grown = self._grown(current, back)
        state = jax.tree_util.tree_map(lambda x: _zeros_on(x, grown), template)
        state = _from_first_replica(state, grown)
        self.trainer = self._trainer(grown)
        return state
