"""The devices of a multi-process job that are still alive, agreed by every live process.

A building block for going on without a restart when a data replica's process dies: the
survivors call :func:`live_devices`, build a mesh of the devices it returns and carry on with
their own copy of the replicated state. It wraps JAX's experimental
``jax.experimental.multihost_utils.live_devices`` (a barrier of the live processes through
the coordination service) with a bounded wait and an error that says what to do.

Requires ``jax.config.update("jax_enable_recoverability", True)`` before
``jax.distributed.initialize`` (or :func:`jaxcoll.init`) in every process; without it the
coordination service ends every process when one dies. Measured on jax 0.10.2, XLA:CPU, gloo,
2 processes x 4 devices (``benchmarks/replica_loss.py``): a dead process is noticed within
about ``heartbeat_timeout_seconds`` (2.5-3.7 s at 3, 8.7-9.7 s at 10); a step that was in a
collective with it raises ``JaxRuntimeError`` (``Gloo all-reduce failed ... Connection reset
by peer``) only after ``--xla_cpu_collective_timeout_seconds`` (jaxcoll-run sets a week: it
hangs) and until then occupies the local devices. Process 0 hosts the coordination service:
if it dies, every process ends (SIGABRT, ``Terminating process because the JAX distributed
service detected fatal errors``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import jax
from jax.experimental import multihost_utils

from .._jax import distributed_state

#: JAX's live-devices context manager keeps the last agreed set in one object per process; a
#: call abandoned at its timeout may still hold it, so no later call may run.
_abandoned: list[str] = []
_MAX_CHANGES = 4


def _agree(devices: list[jax.Device]) -> list[jax.Device]:
    """Enter and leave JAX's ``live_devices`` until a pass sees no change of membership."""
    for _ in range(_MAX_CHANGES):
        try:
            with multihost_utils.live_devices(devices) as live:
                agreed = list(live)
        except multihost_utils.ProcessFailureError:
            continue  # a process died or restarted since the last pass: agree again
        return sorted(agreed, key=lambda d: d.id)
    raise RuntimeError(
        f"live_devices: the job's membership changed {_MAX_CHANGES} times in a row; "
        f"processes keep dying or restarting. Check the processes' logs."
    )


def _checked(devices: Iterable[jax.Device] | None, timeout: float) -> list[jax.Device]:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"live_devices: timeout={timeout!r} must be a number of seconds.")
    if not timeout > 0:
        raise ValueError(f"live_devices: timeout={timeout!r} must be positive, e.g. 60.")
    # A one-shot iterable (``mesh.devices.flat``) would be read empty by JAX's second pass.
    devs = list(jax.devices() if devices is None else devices)
    bad = [d for d in devs if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(
            f"live_devices: devices must be jax.Device objects, got {bad[0]!r}; pass "
            f"jax.devices() or list(mesh.devices.flat)."
        )
    me = jax.process_index()
    if not any(d.process_index == me for d in devs):
        raise ValueError(
            f"live_devices: devices (ids {[d.id for d in devs][:8]}...) hold no device of "
            f"this process ({me}); every process that calls it must pass some of its own."
        )
    return devs


def live_devices(
    devices: Iterable[jax.Device] | None = None, *, timeout: float = 60.0
) -> list[jax.Device]:
    """Return the devices of ``devices`` whose processes are alive, the same list everywhere.

    A barrier: every live process holding one of ``devices`` must call it (at the same point
    of its program, e.g. between two steps), and all of them get the same list, sorted by
    device id. A process that died is left out once the coordination service has noticed
    (about ``heartbeat_timeout_seconds`` after its death); until then the call waits for it.
    A process that restarted under the same id (a replacement) is in the list once it calls
    too. Roughly::

        def live_devices(devices):
            while True:
                try:
                    with jax.experimental.multihost_utils.live_devices(devices) as live:
                        return sorted(live, key=lambda d: d.id)
                except ProcessFailureError:   # membership changed since the last call
                    continue

    Note:
        Build the new mesh with a device order that no earlier mesh of the job used.
        XLA:CPU keeps one gloo communicator per ordered device list and reuses it, and
        publishes its address under ``cpu:gloo/<device ids>/<rank>`` in the coordination
        service for good: after a death, a program over an earlier list (the full mesh, when
        a replacement has rejoined) fails in a survivor with ``Gloo all-reduce failed ...
        Connection closed by peer`` and in the replacement with ``Gloo context
        initialization failed: ALREADY_EXISTS: key cpu:gloo/0,1,...`` (jax 0.10.2). Arrays
        on the old mesh stay readable (``addressable_shards``).

    Args:
        devices: the devices to ask about (default ``jax.devices()``); any iterable.
        timeout: seconds to wait for the live processes to agree (default 60). Give it more
            than the job's ``heartbeat_timeout_seconds``.

    Returns:
        The live devices, sorted by id.

    Raises:
        TimeoutError: the live processes did not all call within ``timeout`` (one is stuck,
            e.g. in a collective with the dead process: lower
            ``--xla_cpu_collective_timeout_seconds``). Later calls then raise RuntimeError.
        RuntimeError: no multi-process job with ``jax_enable_recoverability``, an earlier
            call timed out, or membership kept changing.
        ValueError: ``timeout`` not positive, or ``devices`` without a device of this
            process.
        TypeError: ``timeout`` not a number, or an entry of ``devices`` not a ``jax.Device``.

    Example (every process of a job started with recoverability on)::

        >>> live = jaxcoll.distributed.live_devices(timeout=30)
        >>> mesh = jax.sharding.Mesh(np.array(live), ("data",))
    """
    devs = _checked(devices, timeout)
    if distributed_state().client is None or not jax.config.jax_enable_recoverability:  # type: ignore[attr-defined]
        raise RuntimeError(
            "live_devices: needs a multi-process job started with recoverability: call "
            'jax.config.update("jax_enable_recoverability", True) before '
            "jax.distributed.initialize (or jaxcoll.init) in every process."
        )
    if _abandoned:
        raise RuntimeError(
            f"live_devices: an earlier call timed out ({_abandoned[0]}) and may still be "
            f"waiting; this process cannot ask again. End it and start a replacement."
        )
    return _bounded(devs, timeout)


def _bounded(devs: list[jax.Device], timeout: float) -> list[jax.Device]:
    """:func:`_agree` in a thread, waited for ``timeout`` seconds."""
    box: dict = {}

    def run() -> None:
        try:
            box["live"] = _agree(devs)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="jaxcoll-live-devices", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        _abandoned.append(f"timeout={timeout}")
        raise TimeoutError(
            f"live_devices: the live processes did not all call it within timeout={timeout} "
            f"s. One is stuck (in a collective with a dead process: set "
            f"--xla_cpu_collective_timeout_seconds lower) or never calls it; or the "
            f"heartbeat_timeout_seconds is longer than the timeout."
        )
    if "error" in box:
        raise box["error"]
    return box["live"]
