"""XLA settings for jaxcoll's programs, and the XLA:CPU flags of the processes jaxcoll starts.

What :func:`jaxcoll.init` does to XLA: nothing. It sets no ``XLA_FLAGS``, so every program
that is not jaxcoll's compiles and runs as it would without jaxcoll. (It used to add the
flags below: a plain ``jax.jit`` GSPMD step of the GPT example, fsdp4 x tp2 on 8 simulated
devices, then hung at its third step, and a device failure hung instead of aborting.)
jaxcoll's own programs carry their settings in their compile options
(:func:`compiler_options`), which XLA applies to that executable only; the processes that
``jaxcoll-run`` and the test suite start get :func:`xla_cpu_flags` (below).

Which XLA:CPU settings an executable honours (jaxlib 0.10.2, measured): the scheduler,
``xla_cpu_scheduler_type``, yes (a program compiled with it has the same schedule as one
compiled under the process-wide flag); the deprecated
``xla_cpu_enable_concurrency_optimized_scheduler``, no (accepted, ignored); the rendezvous
timeouts ``xla_cpu_collective_call_warn_stuck_seconds`` and
``xla_cpu_collective_call_terminate_timeout_seconds``, no (read from ``XLA_FLAGS`` once per
process: a 5 s terminate given as a compile option let a collective wait 15 s).

XLA:CPU runs each device's share of a collective on its own thread and joins the threads at a
rendezvous. By default it logs a warning after 20 s and, after 40 s, ends the whole process
with a C++ check failure (``rendezvous.cc ... Termination timeout for all reduce ... Exiting to
ensure a consistent program state``): SIGABRT and a stack trace, no Python exception and no
name of the program. On a loaded machine (simulated devices sharing two cores with another
job) threads do arrive that late, and a healthy program is killed. These limits are
process-wide only, so :func:`xla_cpu_flags` moves them out of the way where a process is
jaxcoll's whole (``jaxcoll-run``'s processes, the test suite, or a script that sets them
itself), so that a slow collective finishes and a stuck one is ended by jaxcoll's watchdog
(``JAXCOLL_FIRST_TIMEOUT`` / ``JAXCOLL_TIMEOUT``, 600 s / 300 s by default) with one line
naming it. :func:`jaxcoll.init` leaves them at XLA's.

XLA:CPU's concurrency-optimized scheduler (on by default in jaxlib 0.10) lets a device start
independent operations in any order, collectives included; when the next step was dispatched
before the last one finished, the simulated devices of one program met at different
collectives and waited for ever (an FSDP x tensor x pipeline step with gradient accumulation
on 8 devices: 5 hangs in 8 runs of 20 steps; none in 8 with the scheduler off, and none
when each step was waited for). jaxcoll's programs compile with the memory-optimized
scheduler (:func:`compiler_options`: ``xla_cpu_scheduler_type``, passed to their
``jax.jit``); as a process-wide flag (``--xla_cpu_enable_concurrency_optimized_scheduler=false``,
which sets the same) it hung plain GSPMD programs that XLA's default schedules well. The
launcher's and the test suite's flags still carry it (``xla_cpu_flags(scheduler=True)``, the
default) for the programs compiled without :func:`compiler_options`.

A device that fails at run time (a host callback raising on a pipeline's last stage) leaves
the others in their next collective; jaxcoll's watchdog sees the failed device's outputs and
ends the process within about a second, naming the program, the device and its mesh position
(:mod:`jaxcoll._watch.watchdog`), whatever the rendezvous timeouts.

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

__all__ = [
    "XLA_CPU_TIMEOUT_S",
    "compiler_options",
    "with_xla_cpu_flags",
    "xla_cpu_flags",
    "xla_gpu_flags",
]

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

#: What jaxcoll's programs compile with (:func:`compiler_options`): one order of the
#: collectives on every device, the scheduler flag of ``_SETTINGS`` for one executable.
_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def compiler_options() -> dict[str, str]:
    """The compile options of jaxcoll's own programs: ``jax.jit(f, compiler_options=...)``.

    XLA:CPU's memory-optimized scheduler, for this executable only: it runs the program's
    collectives in one order on every device, so that overlapping steps never meet at
    different collectives (see the module's docstring). Programs that are not jaxcoll's keep
    XLA's default. ``xla_cpu_scheduler_type`` is a field of XLA's ``DebugOptions``, which
    every backend accepts; only XLA:CPU reads it.

    Returns:
        A new dict, ``{"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}``.
    """
    return dict(_COMPILER_OPTIONS)


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
    end, which is the memory FSDP exists to save. ``jaxcoll-run`` adds them before JAX starts
    its devices (a flag your ``XLA_FLAGS`` sets keeps your setting); a program started
    otherwise sets them itself (:func:`jaxcoll.init` sets no flags)::

        >>> import os, jaxcoll
        >>> os.environ["XLA_FLAGS"] = " ".join(jaxcoll.xla_gpu_flags())

    They cost code that relies on XLA to merge many small collectives of its own (a loop of
    per-leaf ``all_reduce`` calls in one program) one collective each: group those
    (``dp.buckets``), or set a threshold of your own.

    Returns:
        The flags, ``["--xla_gpu_all_gather_combine_threshold_bytes=0", ...]``.
    """
    return list(_GPU_SETTINGS)


def xla_cpu_flags(devices: int | None = None, *, scheduler: bool = True) -> list[str]:
    """The ``XLA_FLAGS`` entries jaxcoll sets for XLA:CPU: its timeouts, one order of the
    collectives on every device, and ``devices``.

    ``jaxcoll-run`` gives them to every process it starts; :func:`jaxcoll.init` sets none
    (they would reach every program of the process, jaxcoll's or not). A program that
    simulates devices without the launcher (a test suite, a notebook) may set them itself,
    before JAX touches a device::

        >>> import os, jaxcoll
        >>> os.environ["XLA_FLAGS"] = " ".join(jaxcoll.xla_cpu_flags(devices=8))

    Without them a collective whose device threads are late by 40 s (a loaded machine) ends
    the process with a C++ abort instead of finishing, and a program whose steps overlap can
    hang with its devices at different collectives.

    Args:
        devices: simulated CPU devices (``--xla_force_host_platform_device_count``); None
            leaves the count alone.
        scheduler: include the process-wide scheduler flag
            (``--xla_cpu_enable_concurrency_optimized_scheduler=false``); False leaves every
            program at XLA's scheduler, jaxcoll's programs taking theirs from
            :func:`compiler_options`.

    Returns:
        The flags, e.g. ``["--xla_force_host_platform_device_count=8",
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=604800", ...]``.
    """
    if devices is not None and (
        isinstance(devices, bool) or not isinstance(devices, int) or devices < 1
    ):
        raise ValueError(f"xla_cpu_flags: devices={devices!r} must be a positive int.")
    count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    settings = list(_SETTINGS) if scheduler else []
    return count + [f"--{name}={XLA_CPU_TIMEOUT_S}" for name in _NAMES] + settings


def with_xla_cpu_flags(
    xla_flags: str, devices: int | None = None, *, scheduler: bool = True
) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) with jaxcoll's XLA:CPU flags and XLA:GPU
    flags (:func:`xla_gpu_flags`; read by a GPU's XLA only) added.

    A flag the value already sets keeps the value's setting (the user's word wins), except the
    device count when ``devices`` is given. ``scheduler``: as :func:`xla_cpu_flags`'s.
    """
    present = xla_flags.split()
    if devices is not None:
        present = [f for f in present if not f.startswith("--xla_force_host_platform_device_count")]
    return merge_flags(
        " ".join(present), xla_cpu_flags(devices, scheduler=scheduler) + xla_gpu_flags()
    )


def merge_flags(xla_flags: str, extra: list[str]) -> str:
    """``xla_flags`` with each flag of ``extra`` added where ``xla_flags`` does not set it."""
    present = xla_flags.split()
    names = {f.split("=", 1)[0] for f in present}
    return " ".join([*present, *(f for f in extra if f.split("=", 1)[0] not in names)])
