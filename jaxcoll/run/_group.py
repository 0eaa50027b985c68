"""One generation of ``jaxcoll-run``'s worker processes: their environment (the job's
variables, the devices of each process's slot), starting them, and stopping them."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from .._xla_flags import with_xla_cpu_flags
from ._output import Proc, pump

_PR_SET_PDEATHSIG = 1
POLL_S = 0.05
_KILLS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT}  # signals sent from outside
COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"  # --recoverable sets it
REPLACEMENT_ENV = {"JAXCOLL_REPLACEMENT": "1"}  # a replacement's mark (--replace)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child_env(
    a: argparse.Namespace,
    coordinator: str,
    bind: str,
    local_rank: int,
    restart: int,
    trace_dir: str | None = None,
    slots: Sequence[int] | None = None,
) -> dict[str, str]:
    """The environment of local process ``local_rank`` of a generation that runs ``slots``
    (the original local ranks still in the job, default all): it takes the devices of slot
    ``slots[local_rank]``."""
    env = {k: v for k, v in os.environ.items() if k not in REPLACEMENT_ENV}  # set by --replace
    slots = list(range(a.nprocs)) if slots is None else list(slots)
    nprocs = len(slots)
    nprocs_total = a.nnodes * nprocs
    slot = slots[local_rank]
    env.update(
        JAXCOLL_COORDINATOR_ADDRESS=coordinator,
        JAXCOLL_COORDINATOR_BIND_ADDRESS=bind,
        JAXCOLL_NUM_PROCESSES=str(nprocs_total),
        JAXCOLL_PROCESS_ID=str(a.node_rank * nprocs + local_rank),
        JAXCOLL_LOCAL_RANK=str(local_rank),
        JAXCOLL_LOCAL_WORLD_SIZE=str(nprocs),
        # The job's first size; a job script that restarts on fewer nodes exports it.
        JAXCOLL_MAX_NPROCS=str(
            max(a.nnodes * a.nprocs, int(os.environ.get("JAXCOLL_MAX_NPROCS", "0") or 0))
        ),
        JAXCOLL_NODE_RANK=str(a.node_rank),
        JAXCOLL_RESTART_COUNT=str(restart),
        JAXCOLL_INIT_TIMEOUT=str(a.init_timeout),
        JAXCOLL_HEARTBEAT_TIMEOUT=str(a.heartbeat_timeout),
        PYTHONUNBUFFERED="1",
    )
    if trace_dir is not None:
        env["JAXCOLL_TRACE_DIR"] = trace_dir
    if a.timeout is not None:
        env["JAXCOLL_TIMEOUT"] = f"{a.timeout:g}"
    if a.first_timeout is not None:
        env["JAXCOLL_FIRST_TIMEOUT"] = f"{a.first_timeout:g}"
    if a.debug is not None:
        env["JAXCOLL_DEBUG"] = a.debug
    d = a.devices_per_proc
    # XLA:CPU's own rendezvous timeouts out of the way: only jaxcoll's watchdog ends a stuck
    # collective, with its message (see jaxcoll._xla_flags).
    xla_flags = env.get("XLA_FLAGS", "")
    if getattr(a, "recoverable", False):
        # A survivor's collective with a dead peer must fail (and raise) after a finite time:
        # --collective-timeout wins over the same flag in XLA_FLAGS.
        kept = [f for f in xla_flags.split() if f.split("=", 1)[0] != COLLECTIVE_TIMEOUT_FLAG]
        xla_flags = " ".join([*kept, f"{COLLECTIVE_TIMEOUT_FLAG}={a.collective_timeout:g}"])
        env["JAXCOLL_RECOVERABLE"] = "1"
    env["XLA_FLAGS"] = with_xla_cpu_flags(xla_flags, d)
    if d is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(d)
        if nprocs_total > 1 or nprocs < a.nprocs:
            env["JAXCOLL_LOCAL_DEVICE_IDS"] = ",".join(
                str(i) for i in range(d * slot, d * (slot + 1))
            )
    return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class _Group:
    """One generation of worker processes."""

    def __init__(
        self,
        a: argparse.Namespace,
        command: list[str],
        restart: int,
        traces: str,
        slots: Sequence[int],
    ):
        self.a, self.command, self.restart = a, command, restart
        self.host_port = a.coordinator or f"127.0.0.1:{free_port()}"
        self.bind = a.bind or self.host_port
        self.lock = threading.Lock()
        self.procs: list[Proc] = []
        self.lost: list[Proc] = []  # --recoverable: processes the job went on without
        self.slots = list(slots)
        self.trace_dir = os.path.join(traces, f"restart{restart}")
        os.makedirs(self.trace_dir, exist_ok=True)
        for local in range(len(self.slots)):
            self.procs.append(self._spawn(local))

    def _spawn(self, local: int, extra: dict[str, str] | None = None) -> Proc:
        """Start local process ``local`` (its environment plus ``extra``)."""
        a = self.a
        index = a.node_rank * len(self.slots) + local
        env = _child_env(
            a, self.host_port, self.bind, local, self.restart, self.trace_dir, self.slots
        )
        env.update(extra or {})
        popen = subprocess.Popen(
            self.command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        proc = Proc(index, popen)
        threading.Thread(target=proc.reap, daemon=True).start()
        prefix = "" if a.no_prefix else f"[{index}] "
        for stream, out, who in (
            (popen.stdout, sys.stdout, None),
            (popen.stderr, sys.stderr, proc),
        ):
            t = threading.Thread(
                target=pump, args=(stream, out, prefix, self.lock, who), daemon=True
            )
            t.start()
            proc.threads.append(t)
        return proc

    def lose(self, proc: Proc) -> None:
        """--recoverable: ``proc`` died and the job goes on without it (no longer in
        :attr:`procs`: not signalled, not waited for)."""
        self.procs.remove(proc)
        self.lost.append(proc)
        for t in proc.threads:
            t.join(timeout=1.0)

    def replace(self, proc: Proc) -> Proc:
        """--recoverable --replace: start a process under lost ``proc``'s id, with the same
        coordinator and environment and ``JAXCOLL_REPLACEMENT=1``."""
        new = self._spawn(proc.index - self.a.node_rank * len(self.slots), REPLACEMENT_ENV)
        self.procs.append(new)
        return new

    def failures(self) -> list[Proc]:
        """Processes that exited non-zero or were killed, earliest first."""
        failed = [
            p for p in self.procs if p.exited_at is not None and p.popen.returncode not in (0, None)
        ]
        return sorted(failed, key=lambda p: p.failed_at())

    def first_cause(self, window: float = 0.5) -> Proc:
        """The failure to name first: the earliest of those not caused by another process's
        failure (see ``_FOLLOW_ON``), unless a process killed from outside (SIGKILL, SIGTERM,
        SIGINT: the OOM killer, ``kill``; it announced nothing) failed within ``window``
        seconds of it. A killed peer's partners can notice the broken connection and exit
        within milliseconds, sometimes before the launcher's thread has recorded the kill;
        the kill is the cause. A process that aborted itself (SIGABRT, SIGSEGV: a library
        failing, often on a peer's exit) is not preferred so: it is named only if it failed
        first."""
        failed = self.failures()
        roots = [p for p in failed if not p.follow_on] or failed
        first = roots[0].failed_at()
        killed = [
            p
            for p in roots
            if p.failed_at() - first < window
            and -p.popen.returncode in _KILLS
            and p.announced_at is None
        ]
        return killed[0] if killed else roots[0]

    def settle(self, wait: float) -> None:
        """After a failure, let the other processes end by themselves for up to ``wait`` s.

        A jaxcoll process learns of a peer's failure within a second or two and exits with a
        line of its own, the process hosting the coordination service last (so JAX aborts
        none); its exit code and line are what it says, not the launcher's SIGTERM."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.all_done():
            time.sleep(POLL_S)

    def all_done(self) -> bool:
        return all(p.exited_at is not None for p in self.procs)

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            try:
                os.killpg(p.popen.pid, sig)  # the process and anything it started
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, grace: float, sig: int = signal.SIGTERM) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds."""
        self.signal_all(sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self.all_done():
            time.sleep(POLL_S)
        self.signal_all(signal.SIGKILL)  # also reaps grandchildren left in the groups
        while not self.all_done():
            time.sleep(POLL_S)

    def join_output(self) -> None:
        for p in self.procs:
            for t in p.threads:
                t.join(timeout=2.0)
