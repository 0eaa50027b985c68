"""``jaxcoll.init``: join a multi-process job (``jax.distributed.initialize``, launcher defaults).

Where the job's shape comes from, first match wins, one source for all three values:

1. the arguments of :func:`init`;
2. jaxcoll's variables, set by ``jaxcoll-run``: ``JAXCOLL_COORDINATOR_ADDRESS``,
   ``JAXCOLL_NUM_PROCESSES``, ``JAXCOLL_PROCESS_ID`` (and ``JAXCOLL_LOCAL_DEVICE_IDS``,
   ``JAXCOLL_COORDINATOR_BIND_ADDRESS``, ``JAXCOLL_INIT_TIMEOUT``,
   ``JAXCOLL_HEARTBEAT_TIMEOUT``, ``JAXCOLL_SHUTDOWN_TIMEOUT``, ``JAXCOLL_RECOVERABLE``: ``1``
   turns JAX's ``jax_enable_recoverability`` on before joining, so the job goes on when a
   process other than 0 dies, with a 3 s heartbeat timeout unless one is given);
3. JAX's: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``;
4. torchrun's: ``MASTER_ADDR`` + ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` (``LOCAL_RANK``
   picks this process's one GPU when ``LOCAL_WORLD_SIZE`` > 1, as torchrun does);
5. JAX's cluster detection (SLURM ``srun``, Open MPI ``mpirun``), done by
   ``jax.distributed.initialize`` itself.

None of them, or a job of one process: :func:`init` does nothing.

This module holds :func:`initialize` and the fail-fast excepthook; the job's shape and its
checks are in ``_spec.py``, joining (once per process) in ``_connect.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import jax

from ._connect import _first_line, _join_once
from ._spec import _cluster, _job_spec, _loopback_bind, _recoverable, _Spec, _timeout

__all__ = ["fail_fast", "initialize"]

# Defaults sized for a job whose launcher watches every process (jaxcoll-run, srun): a peer
# that has not connected after INIT_TIMEOUT, or has sent no heartbeat for HEARTBEAT_TIMEOUT,
# fails the job in well under a minute instead of JAX's 300 s / 100 s.
INIT_TIMEOUT = 30
HEARTBEAT_TIMEOUT = 20
SHUTDOWN_TIMEOUT = 60
# A job that goes on without a lost data replica (``JAXCOLL_RECOVERABLE=1``, or
# ``jax_enable_recoverability`` set before joining; :class:`jaxcoll.dp.Survivor`): the
# survivors learn of a death about this many seconds after it (2.5-3.7 s measured at 3 s,
# ``benchmarks/replica_loss.py``), so a shorter default than a restarted job's.
RECOVERABLE_HEARTBEAT_TIMEOUT = 3


_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]

# Marks jaxcoll's excepthook (an attribute of the function), so that init() never wraps it twice.
_FAIL_FAST_MARK = "jaxcoll_fail_fast"


def fail_fast(leave: Callable[..., None]) -> None:
    """Put in jaxcoll's fail-fast excepthook (once per process), ending the process by
    ``leave(code, line, reason, before, report)``: ``jaxcoll._watch``'s, which first tells the
    other processes of the failure and, in the process hosting JAX's coordination service,
    waits for them to leave."""
    if not getattr(sys.excepthook, _FAIL_FAST_MARK, False):
        sys.excepthook = _fail_fast_hook(sys.excepthook, leave)


def _fail_fast_hook(previous: _ExceptHook, leave: Callable[..., None]) -> _ExceptHook:
    """An excepthook that ends the process at once after reporting an uncaught exception.

    A normal exit runs ``jax.distributed.shutdown`` at exit, which waits for every peer at a
    shutdown barrier; peers blocked in a collective with this process never arrive, so the job
    would hang for the shutdown timeout. Exiting here lets the launcher see the failure now.
    """

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        def report() -> None:
            previous(kind, value, tb)
            sys.stdout.flush()
            sys.stderr.flush()

        # An error every process raises together (a collective mismatch) carries a rendezvous
        # (``before``), so that no process leaves before all have printed theirs. When this
        # process is already leaving (its watchdog gave up, say), the error is a consequence
        # of that and is not reported.
        leave(1, None, _first_line(value), getattr(value, "_jaxcoll_before_exit", None), report)

    setattr(hook, _FAIL_FAST_MARK, True)
    return hook


def initialize(
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
    recoverable: bool | None = None,
) -> bool:
    """Join the multi-process job this process belongs to: the joining half of jaxcoll.init.

    :func:`jaxcoll.init` documents every argument, where each value comes from when not given,
    and the errors; it passes all its arguments here but ``fail_fast`` (:func:`fail_fast`,
    given the watchdog's way to leave) and the watchdog's own, and returns the world group.
    This module stands apart from the groups and the watchdog, so this returns whether it
    joined a job of more than one process. ``tests/distributed/test_init.py`` keeps the
    signatures equal.
    """
    api = "init"
    given = _Spec(
        coordinator_address,
        num_processes,
        process_id,
        None if local_device_ids is None else tuple(local_device_ids),
        "the arguments",
    )
    spec = _job_spec(api, given, cluster_detection_method)
    recoverable = _recoverable(api, recoverable, os.environ)
    init_t = _timeout(
        api, "initialization_timeout", initialization_timeout, "JAXCOLL_INIT_TIMEOUT", INIT_TIMEOUT
    )
    beat_t = _timeout(
        api,
        "heartbeat_timeout",
        heartbeat_timeout,
        "JAXCOLL_HEARTBEAT_TIMEOUT",
        RECOVERABLE_HEARTBEAT_TIMEOUT if recoverable else HEARTBEAT_TIMEOUT,
    )
    stop_t = _timeout(
        api, "shutdown_timeout", shutdown_timeout, "JAXCOLL_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT
    )
    bind = (
        coordinator_bind_address
        or os.environ.get("JAXCOLL_COORDINATOR_BIND_ADDRESS")
        or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
        or _loopback_bind(spec.coordinator_address)
    )

    # No XLA_FLAGS here: they would reach every program of the process, jaxcoll's or not
    # (jaxcoll's programs carry their own compile options; see jaxcoll._xla_flags).

    cluster = None
    if spec.num_processes is None and spec.coordinator_address is None:
        cluster = cluster_detection_method or _cluster(os.environ)
        if cluster is None or cluster == "deactivate":
            return False  # one process, nothing to join
    if spec.num_processes == 1:
        return False
    if recoverable and not jax.distributed.is_initialized():
        # Read by jax.distributed.initialize: the coordination service then lets the other
        # processes go on when one dies, instead of ending them all.
        jax.config.update("jax_enable_recoverability", True)
    _join_once(api, spec, cluster, init_t, beat_t, stop_t, bind)
    return True
