"""XLA:CPU settings every jaxcoll process gets: only jaxcoll's watchdog ends a stuck collective,
and collectives run in one order on every device.

XLA:CPU runs each device's share of a collective on its own thread and joins the threads at a
rendezvous. By default it logs a warning after 20 s and, after 40 s, ends the whole process
with a C++ check failure (``rendezvous.cc ... Termination timeout for all reduce ... Exiting to
ensure a consistent program state``): SIGABRT and a stack trace, no Python exception and no
name of the program. On a loaded machine (simulated devices sharing two cores with another
job) threads do arrive that late, and a healthy program is killed. jaxcoll moves those limits
out of the way, so that a slow collective finishes and a stuck one is ended by jaxcoll's
watchdog (``JAXCOLL_FIRST_TIMEOUT`` / ``JAXCOLL_TIMEOUT``, 600 s / 300 s by default in a
multi-process job) with one line naming it.

XLA:CPU's concurrency-optimized scheduler (on by default in jaxlib 0.10) lets a device start
independent operations in any order, collectives included; when the next step was dispatched
before the last one finished, the simulated devices of one program met at different
collectives and waited for ever (an FSDP x tensor x pipeline step with gradient accumulation
on 8 devices: 5 hangs in 8 runs of 20 steps; none in 8 with the scheduler off, and none
when each step was waited for). jaxcoll turns it off
(``--xla_cpu_enable_concurrency_optimized_scheduler=false``).

On GPUs jaxcoll turns XLA's collective combiners off (:func:`xla_gpu_flags`): jaxcoll
groups its own collectives (DDP's buckets, FSDP's per-block gathers and reduce-scatters), and
XLA:GPU's combiners would merge them across blocks: compiled for 8 GPUs (a mock topology on
an H200), an unrolled 16-layer model's FSDP step had every forward gather hoisted into one at
the top and the 32 gradient reduce-scatters merged into one at the end, every block gathered
and every whole gradient alive at once (24.11 MiB per device, as GSPMD's 24.10); with the
combiners off, 9.27 MiB (the ideal; GSPMD 22.23).

Imports nothing (the launcher uses it without importing JAX).
"""

from __future__ import annotations

__all__ = ["XLA_CPU_TIMEOUT_S", "with_xla_cpu_flags", "xla_cpu_flags", "xla_gpu_flags"]

XLA_CPU_TIMEOUT_S = 7 * 24 * 3600
"""Seconds XLA:CPU waits for a collective's threads before warning or ending the process.

A week: in practice never, so jaxcoll's watchdog (or the user) decides when a collective is
stuck. Set ``JAXCOLL_TIMEOUT`` to have a single process end a stuck collective too.
"""

_NAMES = (
    "xla_cpu_collective_call_warn_stuck_timeout_seconds",
    "xla_cpu_collective_call_terminate_timeout_seconds",
    "xla_cpu_collective_timeout_seconds",
)

#: Settings besides the timeouts (see the module's docstring).
_SETTINGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)

#: XLA:GPU's combiners off: jaxcoll groups its own collectives (see the module's docstring).
_GPU_SETTINGS = (
    "--xla_gpu_all_gather_combine_threshold_bytes=0",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=0",
    "--xla_gpu_all_reduce_combine_threshold_bytes=0",
)


def xla_gpu_flags() -> list[str]:
    """The ``XLA_FLAGS`` entries jaxcoll sets for XLA:GPU: its collective combiners off.

    jaxcoll groups its collectives itself (``bucket_mb``: DDP's buckets, FSDP's gathers and
    reduce-scatters block by block); XLA:GPU's combiners would merge them across blocks,
    hoisting every block's gather to the step's start and keeping every whole gradient to its
    end, which is the memory FSDP exists to save. ``jaxcoll-run`` and :func:`jaxcoll.init`
    add them before JAX starts its devices (a flag your ``XLA_FLAGS`` sets keeps your
    setting); a program that uses neither sets them itself::

        >>> import os, jaxcoll
        >>> os.environ["XLA_FLAGS"] = " ".join(jaxcoll.xla_gpu_flags())

    They cost code that relies on XLA to merge many small collectives of its own (a loop of
    per-leaf ``all_reduce`` calls in one program) one collective each: group those
    (``dp.buckets``), or set a threshold of your own.

    Returns:
        The flags, ``["--xla_gpu_all_gather_combine_threshold_bytes=0", ...]``.
    """
    return list(_GPU_SETTINGS)


def xla_cpu_flags(devices: int | None = None) -> list[str]:
    """The ``XLA_FLAGS`` entries jaxcoll sets for XLA:CPU: its timeouts, one order of the
    collectives on every device, and ``devices``.

    ``jaxcoll-run`` gives them to every process it starts and :func:`jaxcoll.init` adds them
    before JAX starts its devices. A program that simulates devices without either (a test
    suite, a notebook) sets them itself, before JAX touches a device::

        >>> import os, jaxcoll
        >>> os.environ["XLA_FLAGS"] = " ".join(jaxcoll.xla_cpu_flags(devices=8))

    Without them a collective whose device threads are late by 40 s (a loaded machine) ends
    the process with a C++ abort instead of finishing, and a program whose steps overlap can
    hang with its devices at different collectives.

    Args:
        devices: simulated CPU devices (``--xla_force_host_platform_device_count``); None
            leaves the count alone.

    Returns:
        The flags, e.g. ``["--xla_force_host_platform_device_count=8",
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=604800", ...]``.
    """
    if devices is not None and (
        isinstance(devices, bool) or not isinstance(devices, int) or devices < 1
    ):
        raise ValueError(f"xla_cpu_flags: devices={devices!r} must be a positive int.")
    count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    return count + [f"--{name}={XLA_CPU_TIMEOUT_S}" for name in _NAMES] + list(_SETTINGS)


def with_xla_cpu_flags(xla_flags: str, devices: int | None = None) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) with jaxcoll's XLA:CPU flags and XLA:GPU
    flags (:func:`xla_gpu_flags`; read by a GPU's XLA only) added.

    A flag the value already sets keeps the value's setting (the user's word wins), except the
    device count when ``devices`` is given.
    """
    present = xla_flags.split()
    if devices is not None:
        present = [f for f in present if not f.startswith("--xla_force_host_platform_device_count")]
    names = {f.split("=", 1)[0] for f in present}
    ours = xla_cpu_flags(devices) + xla_gpu_flags()
    added = [f for f in ours if f.split("=", 1)[0] not in names]
    return " ".join([*present, *added])
