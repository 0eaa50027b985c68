"""Joining the job once per process: ``jax.distributed.initialize`` with a clear error when a
peer, the coordinator or its port is not there.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from typing import Any

import jax

from .._jax import backends_are_initialized, distributed_state
from ._spec import _Spec

_lock = threading.Lock()
_state: dict[str, Any] = {}


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
