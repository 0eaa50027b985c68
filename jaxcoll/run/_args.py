"""``jaxcoll-run``'s command line: the options, their checks, and the defaults they fill in."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import _recoverable

# jaxcoll.init's heartbeat defaults (jaxcoll/_init/__init__.py), given here too: the launcher
# imports no JAX, and it passes the value to every process it starts (JAXCOLL_HEARTBEAT_TIMEOUT).
HEARTBEAT_TIMEOUT = 20
RECOVERABLE_HEARTBEAT_TIMEOUT = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxcoll-run",
        description="Start N processes of a JAX program on this host as one jax.distributed "
        "job (the torchrun of jaxcoll).",
    )
    _add_job_options(p)
    _add_supervision_options(p)
    _add_watchdog_options(p)
    _add_recovery_options(p)
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    p.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="run the program as a module (python -m), like python -m",
    )
    p.add_argument("program", help="the script (or, with -m, the module) to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")
    return p


def _add_job_options(p: argparse.ArgumentParser) -> None:
    """The job's shape: processes, devices, nodes and where the coordinator listens."""
    p.add_argument(
        "--nprocs",
        "--nproc-per-node",
        default="1",
        dest="nprocs",
        metavar="N|MIN:MAX",
        help="processes to start on this node (default 1); MIN:MAX: start MAX, and when a "
        "process keeps failing past --max-restarts, go on without it while at least MIN "
        "are left (one node only)",
    )
    p.add_argument(
        "--devices-per-proc",
        type=int,
        default=None,
        help="devices per process: simulated CPU devices, and the local "
        "accelerator ids each process gets (default: JAX's own choice)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's coordination service (default: 127.0.0.1 and a free "
        "port; required with --nnodes > 1)",
    )
    p.add_argument(
        "--bind",
        default=None,
        metavar="HOST:PORT",
        help="where the coordination service listens (default: the coordinator "
        "address itself, so loopback for a one-node job)",
    )


def _add_supervision_options(p: argparse.ArgumentParser) -> None:
    """What the launcher does when a process fails, and how long joining may take."""
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole group up to K times after a failure (default 0)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping processes",
    )
    p.add_argument(
        "--init-timeout",
        type=int,
        default=30,
        help="seconds for every process to connect (JAXCOLL_INIT_TIMEOUT)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        help=f"seconds without heartbeat before a peer counts as dead (default "
        f"{HEARTBEAT_TIMEOUT}; {RECOVERABLE_HEARTBEAT_TIMEOUT} with --recoverable)",
    )


def _add_recovery_options(p: argparse.ArgumentParser) -> None:
    """--recoverable: the job goes on without a dead process (dp.Survivor)."""
    p.add_argument(
        "--recoverable",
        action="store_true",
        help="go on when a process other than 0 dies: report it instead of ending the job; "
        "every process gets JAXCOLL_RECOVERABLE=1 and a finite XLA collective timeout "
        "(for dp.Survivor). Process 0's death still ends the job: it hosts the "
        "coordination service. Not with --max-restarts or --nprocs MIN:MAX",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        metavar="S",
        help="with --recoverable: seconds a collective waits for a dead peer before it "
        "raises (XLA:CPU's --xla_cpu_collective_timeout_seconds in XLA_FLAGS; default "
        f"{_recoverable.DEFAULT_COLLECTIVE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="with --recoverable: start one replacement under a dead process's id (same "
        "coordinator and environment, JAXCOLL_REPLACEMENT=1), at most once per id",
    )


def _add_watchdog_options(p: argparse.ArgumentParser) -> None:
    """jaxcoll's watchdog in each process: collective timeouts, flight records, debug."""
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a collective may wait before the watchdog ends its process "
        "once its program has completed before (JAXCOLL_TIMEOUT; default 300 in a "
        "multi-process job, 0 = off)",
    )
    p.add_argument(
        "--first-timeout",
        type=float,
        default=None,
        help="the same before a program's first completion, while peers may still compile "
        "it (JAXCOLL_FIRST_TIMEOUT; default max(600, --timeout))",
    )
    p.add_argument(
        "--trace-dir",
        default=None,
        metavar="DIR",
        help="where the processes write their flight records (default: a temporary "
        "directory, removed after a clean run); analysed when the job fails",
    )
    p.add_argument(
        "--debug",
        choices=("off", "detail"),
        default=None,
        help="'detail': check at each program's first use that every process runs "
        "the same collective (JAXCOLL_DEBUG)",
    )


def _error(msg: str) -> None:
    print(f"jaxcoll-run: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _nprocs(text: str) -> tuple[int, int]:
    """``--nprocs``: ``N`` or ``MIN:MAX``, as (MIN, MAX)."""
    low, sep, high = str(text).partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        _error(f"--nprocs={text} is not a count (4) or a range MIN:MAX (2:4).")
    if lo < 1 or hi < lo:
        _error(f"--nprocs={text} must be at least 1" + (", with MIN <= MAX." if sep else "."))
    return lo, hi


def _check(a: argparse.Namespace) -> None:
    a.min_nprocs, a.nprocs = _nprocs(a.nprocs)
    if a.min_nprocs < a.nprocs and a.nnodes > 1:
        _error(
            f"--nprocs={a.min_nprocs}:{a.nprocs} (elastic) works on one node: with "
            f"--nnodes={a.nnodes} every node's launcher would shrink on its own. Across nodes, "
            f"restart the job on the nodes left (examples/slurm_elastic.sbatch)."
        )
    if a.devices_per_proc is not None and a.devices_per_proc < 1:
        _error(f"--devices-per-proc={a.devices_per_proc} must be at least 1.")
    if a.nnodes < 1:
        _error(f"--nnodes={a.nnodes} must be at least 1.")
    if not 0 <= a.node_rank < a.nnodes:
        _error(
            f"--node-rank={a.node_rank} is out of range for --nnodes={a.nnodes} "
            f"(0..{a.nnodes - 1})."
        )
    if a.nnodes > 1 and a.coordinator is None:
        _error(
            f"--nnodes={a.nnodes} needs --coordinator HOST:PORT (the address of node 0, "
            f"the same on every node)."
        )
    for flag, value in (("--coordinator", a.coordinator), ("--bind", a.bind)):
        if value is not None:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                _error(
                    f"{flag}={value!r} is not HOST:PORT with a port in 1..65535, "
                    f"e.g. 10.0.0.1:29500."
                )
    if a.max_restarts < 0:
        _error(f"--max-restarts={a.max_restarts} must be 0 or more.")
    if a.grace < 0:
        _error(f"--grace={a.grace} must be 0 or more seconds.")
    if a.timeout is not None and not a.timeout >= 0:
        _error(f"--timeout={a.timeout} must be 0 (off) or a positive number of seconds.")
    if a.first_timeout is not None and not a.first_timeout >= 0:
        _error(
            f"--first-timeout={a.first_timeout} must be 0 (off) or a positive number of seconds."
        )
    if (
        a.first_timeout is not None
        and a.timeout
        and (a.first_timeout == 0 or a.first_timeout < a.timeout)
    ):
        _error(
            f"--first-timeout={a.first_timeout:g} is shorter than --timeout={a.timeout:g}: "
            f"a program's first run waits for its peers' compiles too. Set it to at least "
            f"{a.timeout:g}, or leave it out."
        )
    _check_recovery(a)
    if a.init_timeout < 1 or a.heartbeat_timeout < 1:
        _error("--init-timeout and --heartbeat-timeout must be at least 1 second.")
    if not a.module and not os.path.exists(a.program):
        _error(f"program {a.program!r} does not exist. Pass a script path, or -m MODULE.")


def _check_recovery(a: argparse.Namespace) -> None:
    """--recoverable, --collective-timeout, --replace; the heartbeat timeout's default."""
    if not a.recoverable:
        for flag, given in (
            ("--collective-timeout", a.collective_timeout is not None),
            ("--replace", a.replace),
        ):
            if given:
                _error(f"{flag} needs --recoverable (the job going on without a dead process).")
        if a.heartbeat_timeout is None:
            a.heartbeat_timeout = HEARTBEAT_TIMEOUT
        return
    if a.max_restarts:
        _error(
            f"--recoverable with --max-restarts={a.max_restarts}: the job goes on without a "
            f"dead process instead of restarting the group. Use one of them."
        )
    if a.min_nprocs < a.nprocs:
        _error(
            f"--recoverable with --nprocs={a.min_nprocs}:{a.nprocs} (elastic restarts): the "
            f"job goes on without a dead process instead of restarting the group. Give "
            f"--nprocs {a.nprocs}."
        )
    if a.collective_timeout is None:
        a.collective_timeout = _recoverable.DEFAULT_COLLECTIVE_TIMEOUT_S
    if not a.collective_timeout > 0:
        _error(
            f"--collective-timeout={a.collective_timeout} must be a positive number of "
            f"seconds: a survivor's collective with a dead process must end."
        )
    if a.heartbeat_timeout is None:
        a.heartbeat_timeout = RECOVERABLE_HEARTBEAT_TIMEOUT


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The checked options (``--nprocs`` as ``nprocs`` = MAX and ``min_nprocs`` = MIN)."""
    a = _parser().parse_args(argv)
    _check(a)
    return a
