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
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import jax

from ._jax import backends_are_initialized, distributed_state

__all__ = ["initialize"]

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

_SOURCES = (
    ("jaxcoll", "JAXCOLL_COORDINATOR_ADDRESS", "JAXCOLL_NUM_PROCESSES", "JAXCOLL_PROCESS_ID"),
    ("jax", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
)
_CLUSTER_MARKERS = {
    "slurm": (
        "SLURM_JOB_ID",
        "SLURM_STEP_NODELIST",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
    ),
    "ompi": ("OMPI_MCA_orte_hnp_uri",),
}


@dataclass(frozen=True)
class _Spec:
    """Where this process sits in the job, and where that came from."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None
    source: str


_lock = threading.Lock()
_state: dict[str, Any] = {}


def _int_env(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"init: environment variable {name}={value!r} is not an integer. Unset it or set it "
            f"to a whole number."
        ) from None


def _ids_env(env: Mapping[str, str], name: str) -> tuple[int, ...] | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise ValueError(
            f"init: environment variable {name}={value!r} must be comma-separated device ids "
            f"such as '0,1,2,3'."
        ) from None


def _from_env(env: Mapping[str, str]) -> _Spec | None:
    """The job shape from the first source of variables that is present, or None."""
    for source, addr_var, count_var, id_var in _SOURCES:
        present = [v for v in (addr_var, count_var, id_var) if v in env]
        if not present:
            continue
        missing = [v for v in (addr_var, count_var, id_var) if v not in env]
        if missing:
            raise ValueError(
                f"init: {', '.join(present)} is set but {', '.join(missing)} is not; set all "
                f"three of {addr_var}, {count_var}, {id_var} (or none)."
            )
        ids = _ids_env(env, "JAXCOLL_LOCAL_DEVICE_IDS") if source == "jaxcoll" else None
        return _Spec(
            env[addr_var],
            _int_env(env, count_var),
            _int_env(env, id_var),
            ids,
            f"{source} environment variables",
        )
    torch_vars = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    if all(v in env for v in torch_vars):
        ids = None
        if (
            "LOCAL_RANK" in env
            and "LOCAL_WORLD_SIZE" in env
            and _int_env(env, "LOCAL_WORLD_SIZE") > 1
        ):
            ids = (_int_env(env, "LOCAL_RANK"),)
        return _Spec(
            f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
            _int_env(env, "WORLD_SIZE"),
            _int_env(env, "RANK"),
            ids,
            "torchrun environment variables",
        )
    return None


def _cluster(env: Mapping[str, str]) -> str | None:
    """The cluster manager that started this process with several tasks, if any."""
    for name, markers in _CLUSTER_MARKERS.items():
        if all(m in env for m in markers):
            count = env.get("SLURM_NTASKS" if name == "slurm" else "OMPI_COMM_WORLD_SIZE", "2")
            if count.isdigit() and int(count) > 1:
                return name
    return None


def _recoverable(api: str, given: bool | None, env: Mapping[str, str]) -> bool:
    """Whether the job goes on when a process dies: ``given`` (``init(recoverable=)``), else
    ``JAXCOLL_RECOVERABLE`` (``1``/``0``), else whether ``jax_enable_recoverability`` was
    already set in this process.

    In such a job a survivor's collective with a dead process fails after XLA's collective
    timeout (on CPU ``--xla_cpu_collective_timeout_seconds``, read from ``XLA_FLAGS`` once per
    process: the launcher sets it, e.g. ``jaxcoll._xla_flags.with_xla_cpu_flags(
    "--xla_cpu_collective_timeout_seconds=5", devices)``; the week ``jaxcoll-run`` sets lets
    it hang), and :func:`jaxcoll.distributed.live_devices` then lists the live devices.
    """
    if given is not None:
        if not isinstance(given, bool):
            raise TypeError(
                f"{api}: recoverable must be True, False or None, got {given!r} of type "
                f"{type(given).__name__} instead."
            )
        return given
    raw = env.get("JAXCOLL_RECOVERABLE", "").strip().lower()
    if raw in ("1", "true", "yes"):
        return True
    if raw not in ("", "0", "false", "no"):
        raise ValueError(
            f"{api}: environment variable JAXCOLL_RECOVERABLE={raw!r} must be 1 (the job goes "
            f"on when a process dies) or 0 (the default: it ends)."
        )
    return bool(raw == "" and getattr(jax.config, "jax_enable_recoverability", False))


def _timeout(api: str, argname: str, value: int | None, env_var: str, default: int) -> int:
    if value is None:
        value = _int_env(os.environ, env_var) if env_var in os.environ else default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{api}: {argname} must be an int number of seconds, got {value!r} of "
            f"type {type(value).__name__} instead."
        )
    if value <= 0:
        raise ValueError(f"{api}: {argname}={value} must be a positive number of seconds.")
    return value


def _check_spec(api: str, spec: _Spec) -> None:
    n, pid = spec.num_processes, spec.process_id
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise TypeError(
            f"{api}: num_processes must be an int, got {n!r} of type {type(n).__name__} instead."
        )
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int)):
        raise TypeError(
            f"{api}: process_id must be an int, got {pid!r} of type {type(pid).__name__} instead."
        )
    if n is not None and n < 1:
        raise ValueError(f"{api}: num_processes={n} (from {spec.source}) must be at least 1.")
    if n is not None and pid is not None and not 0 <= pid < n:
        raise ValueError(
            f"{api}: process_id={pid} (from {spec.source}) is out of range for a job of {n} "
            f"processes (0..{n - 1}). Give each process a distinct id between 0 and {n - 1}."
        )
    addr = spec.coordinator_address
    if addr is not None:
        if not isinstance(addr, str):
            raise TypeError(
                f"{api}: coordinator_address must be a 'host:port' string, got {addr!r} instead."
            )
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"{api}: coordinator_address={addr!r} (from {spec.source}) is not 'host:port' "
                f"with a port in 1..65535, e.g. '10.0.0.1:29500'."
            )


def _loopback_bind(address: str | None) -> str | None:
    """``address`` itself when its host is a loopback address, else None (JAX's default).

    JAX's coordinator listens on every interface (``[::]:port``) unless told otherwise, and it
    has no authentication. A job whose coordinator is named by a loopback address (torchrun's
    ``MASTER_ADDR=127.0.0.1``, a hand-written ``JAX_COORDINATOR_ADDRESS=localhost:1234``) can
    only be joined from this host, so listen there only.
    """
    if not address:
        return None
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return address
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: where it resolves is the network's business
        return None
    return address if loopback else None


def _exit_now(
    code: int,
    line: str | None = None,
    reason: str | None = None,
    before: Callable[[], None] | None = None,
    report: Callable[[], None] | None = None,
) -> None:
    if report is not None:
        report()
    if before is not None:
        before()
    os._exit(code)


leave: Callable[..., None] = _exit_now
"""How the fail-fast hook ends the process: ``leave(code, line, reason, before, report)``.

:func:`jaxcoll.init` puts in ``jaxcoll._watch``'s, which first tells the other processes of
the failure and, in the process hosting JAX's coordination service, waits for them to leave.
"""


_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]

# Marks jaxcoll's excepthook (an attribute of the function), so that init() never wraps it twice.
_FAIL_FAST_MARK = "jaxcoll_fail_fast"


def _fail_fast_hook(previous: _ExceptHook) -> _ExceptHook:
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
    fail_fast: bool = True,
    recoverable: bool | None = None,
) -> None:
    """Join the multi-process job this process belongs to: the joining half of jaxcoll.init.

    :func:`jaxcoll.init` documents every argument, where each value comes from when not given,
    and the errors; it passes all its arguments here but ``timeout`` and ``debug`` (the
    watchdog's, which it starts after this returns) and returns the world group. This module
    stands apart from the groups, so this returns None. The signatures are kept equal by
    ``tests/distributed/test_init.py``.
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
            return None  # one process, nothing to join
    if spec.num_processes == 1:
        return None
    if recoverable and not jax.distributed.is_initialized():
        # Read by jax.distributed.initialize: the coordination service then lets the other
        # processes go on when one dies, instead of ending them all.
        jax.config.update("jax_enable_recoverability", True)
    _join_once(api, spec, cluster, init_t, beat_t, stop_t, bind)
    if fail_fast and not getattr(sys.excepthook, _FAIL_FAST_MARK, False):
        sys.excepthook = _fail_fast_hook(sys.excepthook)
    return None


def _job_spec(api: str, given: _Spec, cluster_detection_method: str | None) -> _Spec:
    """The job's shape, checked: the arguments when they name any of the three values, else
    the first source of variables (``local_device_ids`` from the arguments when given)."""
    if (
        given.coordinator_address is not None
        or given.num_processes is not None
        or given.process_id is not None
    ):
        spec = given
    else:
        env_spec = _from_env(os.environ)
        spec = env_spec if env_spec is not None else given
        if given.local_device_ids is not None:
            spec = replace(spec, local_device_ids=given.local_device_ids)
    _check_spec(api, spec)
    named = (
        ("coordinator_address", given.coordinator_address),
        ("num_processes", given.num_processes),
        ("process_id", given.process_id),
    )
    missing = [name for name, v in named if v is None]
    if (
        spec is given
        and 0 < len(missing) < 3
        and given.num_processes != 1
        and cluster_detection_method is None
        and _cluster(os.environ) is None
    ):
        got = ", ".join(f"{name}={v!r}" for name, v in named if v is not None)
        raise ValueError(
            f"{api}: got {got} but no {' or '.join(missing)}. Pass all three "
            f"(coordinator_address is process 0's 'host:port', the same in every process), "
            f"or none and let jaxcoll-run / torchrun / SLURM variables supply them."
        )
    return spec


def _join_once(api, spec, cluster, init_t, beat_t, stop_t, bind) -> None:
    """Join the job unless this process already has; joining a different job is an error."""
    key = (spec.coordinator_address, spec.num_processes, spec.process_id)
    with _lock:
        if jax.distributed.is_initialized():
            done = _state.get("key")
            if done is not None and cluster is None and done != key:
                raise ValueError(
                    f"{api}: this process already joined the job (coordinator_address, "
                    f"num_processes, process_id)={done}; it cannot join {key} as well. Call "
                    f"init once per process."
                )
            return
        _connect(api, spec, cluster, init_t, beat_t, stop_t, bind)
        _state["key"] = key


def _connect(api, spec, cluster, init_t, beat_t, stop_t, bind) -> None:
    if backends_are_initialized():
        raise RuntimeError(
            f"{api}: JAX has already started its devices in this process, so it can no longer "
            f"join a multi-process job. Call jaxcoll.init() first, before jax.devices(), "
            f"jax.device_put or any computation."
        )
    # jax.config sets its options as attributes at runtime; its class declares none of them.
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]
    if (
        platforms in (None, "", "cpu")
        and os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION") is None
    ):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = spec.coordinator_address or f"the {cluster} job's coordinator"
    if spec.process_id == 0 and spec.coordinator_address:
        _check_port_free(api, spec, bind or f"[::]:{spec.coordinator_address.rpartition(':')[2]}")
    # When a peer or the coordinator never shows up, XLA ends the process from a C++ thread
    # (abort, no Python exception). Say what happened, in one line, just before it does.
    message = (
        f"{api}: process {spec.process_id} of {spec.num_processes} could not join the job at "
        f"{where} (values from {spec.source}) within initialization_timeout={init_t}s: the "
        f"coordinator was unreachable or not every process connected. Check that process 0 "
        f"is running and reachable at that address and that every process was started. "
        f"Exiting with code 1."
    )
    watchdog = threading.Timer(max(init_t - 0.5, init_t * 0.9), _give_up, (message,))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            spec.coordinator_address,
            spec.num_processes,
            spec.process_id,
            local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
            # Values given (arguments, jaxcoll/JAX/torchrun variables): no cluster detection, or
            # JAX's SLURM detector would also pin each process to GPU $SLURM_LOCALID only.
            cluster_detection_method=cluster
            if cluster in ("slurm", "ompi", "mpi4py")
            else (None if cluster else "deactivate"),
            initialization_timeout=init_t,
            heartbeat_timeout_seconds=beat_t,
            shutdown_timeout_seconds=stop_t,
            coordinator_bind_address=bind,
        )
    except Exception as e:  # XLA raises its own status errors; give one clear message
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 - best effort, the original error matters
            pass
        distributed_state().service = None
        distributed_state().client = None
        raise ValueError(
            f"{api}: process {spec.process_id} of {spec.num_processes} could not join the job "
            f"at {where} (values from {spec.source}) within initialization_timeout={init_t}s: "
            f"{_first_line(e)}. Check that process 0 is running and reachable at that "
            f"address, that its port is free, and that every process was started."
        ) from e
    finally:
        watchdog.cancel()


def _check_port_free(api: str, spec: _Spec, bind: str) -> None:
    """Raise if the coordination service could not listen at ``bind`` (process 0 only).

    JAX's service does not report a port already in use: the process can crash (SIGSEGV) or
    hang until the initialization timeout. Binding a socket there first (and closing it)
    gives the one clear message instead.
    """
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(
                (
                    host if host not in ("", "::") else "::" if family == socket.AF_INET6 else "",
                    int(port),
                )
            )
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return  # not ours to judge (an address of another host, say): JAX will tell
        raise ValueError(
            f"{api}: process 0 hosts the job's coordination service at {bind} (coordinator "
            f"address {spec.coordinator_address!r}, from {spec.source}), but port {port} is "
            f"already in use by another program. Pick a free port (jaxcoll-run does when "
            f"--coordinator is not given) or end the program that holds it."
        ) from None


def _give_up(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
