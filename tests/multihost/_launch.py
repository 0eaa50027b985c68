"""Launch real multi-process jobs through ``python -m jaxcoll.run`` and inspect what is left."""

from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import sys
import time
import uuid

import numpy as np

from tests.compile_flags import FAST_COMPILE, with_fast_compile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "multihost", "workers")
TOKEN_VAR = "JAXCOLL_TEST_JOB"


@dataclasses.dataclass
class Job:
    """A finished launcher run."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    token: str


def start(launcher_args: list[str], worker: str, worker_args: list[str]):
    """Start the launcher; return (Popen, token). The token marks every process of the job."""
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOLL_")}
    env[TOKEN_VAR] = token
    # The launcher adds the device count per process to these (tests/compile_flags.py).
    env["XLA_FLAGS"] = FAST_COMPILE
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [
        sys.executable,
        "-m",
        "jaxcoll.run",
        *launcher_args,
        os.path.join(WORKERS, worker),
        *worker_args,
    ]
    popen = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return popen, token


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_each(
    nprocs: int,
    devices: int,
    worker: str,
    worker_args: list[str],
    *,
    env: dict[str, str] | None = None,
    xla_flags: str = "",
    logs: str,
    coordinator: str | None = None,
    ids: list[int] | None = None,
    token: str | None = None,
    tag: str = "",
) -> tuple[list[subprocess.Popen], str]:
    """Start the job's processes one by one, without the launcher (which ends the job when one
    dies): a job that goes on without a dead process (``dp.Survivor``). Return (the Popens,
    in process order, each writing its output to ``logs/p{k}.log``; the token).

    Each process gets jaxcoll's job variables (process 0's coordinator on a free port),
    ``devices`` simulated CPU devices, the launcher's XLA:CPU flags on top of ``xla_flags``
    (which wins where both set a flag) and ``env`` last. The caller ends them: every process
    carries the token (:func:`survivors`). To start a replacement into a running job, pass its
    ``coordinator`` (``127.0.0.1:<free_port()>`` given to the first call), ``token`` and
    ``ids`` (the processes to start; default all), and a ``tag`` for its log's name
    (``p{k}{tag}.log``)."""
    from jaxcoll._xla_flags import with_xla_cpu_flags

    coordinator = coordinator or f"127.0.0.1:{free_port()}"
    token = token or uuid.uuid4().hex
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAXCOLL_", "JAX_"))}
    base.update(
        {
            TOKEN_VAR: token,
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(devices),
            "XLA_FLAGS": with_fast_compile(with_xla_cpu_flags(xla_flags, devices)),
            "JAXCOLL_COORDINATOR_ADDRESS": coordinator,
            "JAXCOLL_NUM_PROCESSES": str(nprocs),
            "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
    )
    popens = []
    for k in range(nprocs) if ids is None else ids:
        with open(os.path.join(logs, f"p{k}{tag}.log"), "w") as log:  # the child keeps its own fd
            popens.append(
                subprocess.Popen(
                    [sys.executable, os.path.join(WORKERS, worker), *worker_args],
                    cwd=ROOT,
                    env={**base, "JAXCOLL_PROCESS_ID": str(k)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return popens, token


def finish(popen: subprocess.Popen, token: str, started: float, timeout: float) -> Job:
    out, err = popen.communicate(timeout=timeout)
    return Job(popen.returncode, out, err, time.monotonic() - started, token)


def launch(
    launcher_args: list[str], worker: str, worker_args: list[str], timeout: float = 120
) -> Job:
    """Run the launcher to completion."""
    t0 = time.monotonic()
    popen, token = start(launcher_args, worker, worker_args)
    return finish(popen, token, t0, timeout)


def survivors(token: str) -> list[int]:
    """Pids of live processes (zombies excluded) whose environment carries ``token``."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        pid = int(path.split("/")[2])
        try:
            with open(path, "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or not ours to read
            continue
        if state != "Z":
            found.append(pid)
    return found


def load_rows(out_dir: str) -> dict[str, dict[int, np.ndarray]]:
    """Merge every process's ``p*.npz``: name -> {row: value}."""
    merged: dict[str, dict[int, np.ndarray]] = {}
    files = sorted(glob.glob(os.path.join(out_dir, "p*.npz")))
    for path in files:
        with np.load(path) as data:
            for key in data.files:
                name, row = key.rsplit("@", 1)
                merged.setdefault(name, {})[int(row)] = data[key]
    return merged
