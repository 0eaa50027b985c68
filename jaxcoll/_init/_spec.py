"""Where a job's shape comes from: the arguments, jaxcoll's, JAX's or torchrun's variables, or
a cluster manager; each value checked, and the timeouts, recoverability and bind address.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import jax

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
