"""``jaxcoll.init``: join the multi-process job, start the watchdog, return the world group."""

from __future__ import annotations

from collections.abc import Sequence

from .. import _init, _watch
from ..groups import Group
from ._group import world


def init(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout: int | None = None,
    heartbeat_timeout: int | None = None,
    shutdown_timeout: int | None = None,
    coordinator_bind_address: str | None = None,
    cluster_detection_method: str | None = None,
    fail_fast: bool = True,
    recoverable: bool | None = None,
    timeout: float | None = None,
    debug: str | None = None,
    first_timeout: float | None = None,
) -> Group:
    """Join the multi-process job this process belongs to and return the world group.

    Like ``torch.distributed.init_process_group()``: call it once at the start of every
    process, before any other JAX call. It wraps ``jax.distributed.initialize`` (XLA's
    coordination service; process 0 hosts it), so that afterwards ``jax.devices()`` lists the
    devices of every process and one mesh spans them all. Roughly::

        def init(coordinator_address, num_processes, process_id):
            if num_processes == 1:
                return dist.world()                  # nothing to join
            if on_cpu:
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                       initialization_timeout=30, heartbeat_timeout_seconds=20)
            return dist.world()

    Where the values come from when not given (first match wins): jaxcoll's variables
    (``JAXCOLL_COORDINATOR_ADDRESS``, ``JAXCOLL_NUM_PROCESSES``, ``JAXCOLL_PROCESS_ID``, set
    by ``jaxcoll-run``), JAX's (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID``), torchrun's (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
    ``RANK``, ``LOCAL_RANK``), then JAX's own detection of SLURM and Open MPI. With none of
    them, or ``num_processes == 1``, it joins nothing: the single-process program runs
    unchanged.

    Collectives across processes run over NCCL on GPUs and over gloo (TCP) on CPU; on CPU this
    selects gloo unless ``jax_cpu_collectives_implementation`` was set otherwise.

    After joining, it also starts jaxcoll's collective watchdog (``timeout``), mismatch
    detection if asked (``debug``), records a normal exit in the job's key-value store for the
    peers' watchdogs, and replaces JAX's SIGTERM handler, which only logs: SIGTERM then ends
    the process at once with exit code 143, unless a loop claimed it with
    :func:`jaxcoll.handle_preemption`.

    Note:
        A rank in jaxcoll is a device, not a process: with 2 processes x 4 devices there are
        8 ranks, process ``p`` holding ranks ``4p .. 4p+3`` (JAX's global device order).

    Args:
        coordinator_address: ``"host:port"`` of process 0's coordination service.
        num_processes: processes in the job.
        process_id: this process's index, ``0 <= process_id < num_processes``.
        local_device_ids: the local accelerators this process uses (default: all, or the
            launcher's ``JAXCOLL_LOCAL_DEVICE_IDS``).
        initialization_timeout: seconds to wait for every process to connect (default 30,
            or ``JAXCOLL_INIT_TIMEOUT``). A peer that never starts fails the job after this.
        heartbeat_timeout: seconds without a heartbeat after which a peer counts as dead
            (default 20, or ``JAXCOLL_HEARTBEAT_TIMEOUT``).
        shutdown_timeout: seconds a finished process waits for the others at exit (default 60,
            or ``JAXCOLL_SHUTDOWN_TIMEOUT``).
        coordinator_bind_address: where process 0's service listens (default: the
            launcher's ``JAXCOLL_COORDINATOR_BIND_ADDRESS`` or ``JAX_COORDINATOR_BIND_ADDRESS``;
            else the coordinator address itself when it is a loopback address, whichever
            variables named it; else JAX's all-interfaces ``[::]:port``). The service has no
            authentication: keep its port on a trusted network.
        cluster_detection_method: passed to JAX (``"slurm"``, ``"ompi"``, ``"mpi4py"``,
            ``"deactivate"``).
        fail_fast: if True (the default), an uncaught exception in a multi-process job ends
            this process right after its traceback (exit code 1), instead of waiting at JAX's
            exit barrier for peers that may be blocked in a collective with it.
        recoverable: if True, the job goes on when a process other than 0 dies (JAX's
            ``jax_enable_recoverability``, set before joining; the heartbeat timeout then
            defaults to 3 s): the survivors' collectives with it fail, and
            :func:`jaxcoll.distributed.live_devices` lists the devices left
            (:class:`jaxcoll.dp.Survivor` goes on with them). XLA:CPU's collective timeout
            must then be finite (``--xla_cpu_collective_timeout_seconds`` in ``XLA_FLAGS``).
            None (the default): ``JAXCOLL_RECOVERABLE`` (``1``/``0``), else off.
        timeout: seconds a collective (every ``dist`` call, a :func:`jaxcoll.watch`-ed
            function, outputs given to :func:`jaxcoll.watch_outputs`) whose program has
            completed before in this process may take before the watchdog ends this process
            with one line naming it (default 300 in a multi-process job, off in a single
            process, or ``JAXCOLL_TIMEOUT``, set by ``jaxcoll-run --timeout``; 0 = off). It
            counts from when the call became this process's oldest unfinished one.
        debug: ``"detail"`` (or ``JAXCOLL_DEBUG=detail``) checks, at the first use of every
            collective program, that all processes run the same one, and raises on every
            process naming what differs. Costs one key-value round trip per new program.
            ``"off"`` (the default) checks nothing.
        first_timeout: the same before a program's first completion, when the peers may
            still be compiling it or restoring a checkpoint (default: 600 or ``timeout`` if
            longer, or ``JAXCOLL_FIRST_TIMEOUT``, set by ``jaxcoll-run --first-timeout``;
            off when ``timeout`` is). May not be shorter than ``timeout``. The flight
            recorder (:func:`jaxcoll.dump_trace`) records in every multi-process job,
            whatever the timeouts.

    Returns:
        The world group, ``dist.world()``: every device of every process (of this process
        alone when there is no job to join).

    Raises:
        ValueError: a bad or incomplete address, count or id (from the arguments or the
            environment), a second call with a different job shape, or a failed connection
            (coordinator unreachable, its port taken, a peer missing), reported within
            ``initialization_timeout``; a bad ``timeout`` or ``debug`` (or
            ``JAXCOLL_TIMEOUT`` / ``JAXCOLL_DEBUG``), before joining.
        RuntimeError: JAX has already started its backend in this process (call ``init``
            before any other JAX call).
        TypeError: ``num_processes`` or ``process_id`` not an int, ``coordinator_address``
            not a string, ``timeout`` not a number (``num_processes=2.0``).

    Example (run under ``jaxcoll-run --nprocs 2 --devices-per-proc 4 script.py``)::

        >>> import jaxcoll
        >>> world = jaxcoll.init()
        >>> jax.process_count(), jax.device_count(), len(jax.local_devices())
        (2, 8, 4)
    """
    timeout_setting = "env" if timeout is None else timeout
    debug_setting = "env" if debug is None else debug
    first_setting = "env" if first_timeout is None else first_timeout
    # bad values fail before joining
    _watch.configure(timeout_setting, debug_setting, first_setting)
    joined = _init.initialize(
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout=heartbeat_timeout,
        shutdown_timeout=shutdown_timeout,
        coordinator_bind_address=coordinator_bind_address,
        cluster_detection_method=cluster_detection_method,
        recoverable=recoverable,
    )
    if joined and fail_fast:
        _init.fail_fast(_watch.leave)  # a failure tells the other processes first
    _watch.start(timeout_setting, debug_setting, first_setting)
    return world()
