"""Loops of eager collectives end: the bound on calls in flight, and one process's watchdog.

XLA:CPU deadlocks once about 34 collective programs are queued with none waited for, so the
loops run in a child process (a hang there fails the test at its timeout instead of stopping
the suite), and the bound itself is checked in-process.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jaxcoll
from jaxcoll import distributed as dist
from jaxcoll._watch import process
from jaxcoll.distributed import _inflight

HERE = os.path.dirname(os.path.abspath(__file__))


def _child(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOLL_")}
    base["XLA_FLAGS"] = " ".join(jaxcoll.xla_cpu_flags(devices=8))
    base["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


LOOPS = """
    import numpy as np
    import jaxcoll.distributed as dist

    n = 8
    x = dist.per_rank(lambda r: np.full((1_000_000,), float(r), np.float32))
    for i in range(120):  # torch's first loop: no wait between the calls
        y = dist.all_reduce(x)
    assert dist.to_ranks(y)[0][0] == 28.0, dist.to_ranks(y)[0][:2]

    v = dist.per_rank(lambda r: np.full((n, 4096), r + 1.0, np.float32))
    ring = [(r, (r + 1) % n) for r in range(n)]
    ops = {
        "all_reduce": lambda: dist.all_reduce(v, async_op=True),
        "reduce": lambda: dist.reduce(v, dst=3, async_op=True),
        "broadcast": lambda: dist.broadcast(v, src=2, async_op=True),
        "all_gather": lambda: dist.all_gather(v, async_op=True),
        "gather": lambda: dist.gather(v, dst=1, async_op=True),
        "scatter": lambda: dist.scatter(v, src=0, async_op=True),
        "reduce_scatter": lambda: dist.reduce_scatter(v, async_op=True),
        "all_to_all": lambda: dist.all_to_all(v, async_op=True),
        "sendrecv": lambda: dist.sendrecv(v, ring, async_op=True),
        "isend": lambda: dist.isend(v, dst=5, src=4),
    }
    for name, call in ops.items():
        works = [call() for _ in range(120)]  # handles kept, none waited for
        out = dist.to_ranks(works[-1].wait())
        print(name, float(np.sum(out)), flush=True)
"""


def test_loops_of_eager_collectives_end():
    # Before the bound, the first loop hung in every run (4 of 4; from 38 calls queued).
    job = _child(LOOPS, {}, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    sums = dict(line.split() for line in job.stdout.splitlines())
    rows = np.stack([np.full((8, 4096), r + 1.0) for r in range(8)])  # rank r: r + 1
    expected = {
        "all_reduce": 8 * rows.sum(0).sum(),
        "broadcast": 8 * rows[2].sum(),
        "all_gather": 8 * rows.sum(),
        "all_to_all": rows.sum(),
        "sendrecv": rows.sum(),
        "reduce_scatter": rows.sum(0).sum(),
    }
    for name, total in expected.items():
        assert float(sums[name]) == pytest.approx(total), (name, sums[name], total)
    assert sorted(sums) == sorted(
        [
            "all_reduce",
            "reduce",
            "broadcast",
            "all_gather",
            "gather",
            "scatter",
            "reduce_scatter",
            "all_to_all",
            "sendrecv",
            "isend",
        ]
    )


STUCK = """
    import threading
    import jax, numpy as np
    import jaxcoll.distributed as dist

    never = threading.Event()

    def blocked(v):  # a host callback that never returns: the collective after it waits
        never.wait()
        return v

    x = dist.per_rank(lambda r: np.full((4,), float(r), np.float32))
    x = jax.jit(lambda v: jax.pure_callback(blocked, v, v), out_shardings=x.sharding)(x)
    y = dist.all_reduce(x)  # the stuck call
    print(dist.to_ranks(y))
"""


STUCK_LINE = (
    textwrap.dedent(STUCK).splitlines().index("y = dist.all_reduce(x)  # the stuck call") + 1
)


def test_a_stuck_collective_in_one_process_ends_naming_the_call():
    # One process, no jaxcoll.init: the watchdog is on by default (600 s before a program's
    # first completion); here 3 s, so the test is short. Before, it waited for ever.
    job = _child(STUCK, {"JAXCOLL_TIMEOUT": "3", "JAXCOLL_FIRST_TIMEOUT": "3"}, timeout=120)
    assert job.returncode == 1, (job.returncode, job.stderr[-3000:])
    assert re.search(
        r"jaxcoll: process 0 of 1 timed out after 3\.\ds \(timeout 3s\) waiting for "
        rf"dist\.all_reduce\(float32\[8,4\]\) \(call #1 at <string>:{STUCK_LINE}\): it never "
        r"finished",
        job.stderr,
    ), job.stderr[-3000:]
    m = re.search(
        r"wrote its flight record to (\S+) \(python -m jaxcoll\.trace (\S+)\)", job.stderr
    )
    assert m is not None, job.stderr[-3000:]
    assert os.path.dirname(m.group(1)) == m.group(2) and os.path.exists(m.group(1))


def test_one_process_gets_the_watchdog_by_default(monkeypatch):
    for var in ("JAXCOLL_TIMEOUT", "JAXCOLL_FIRST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    try:
        process.configure("env", "off", joined=False)
        assert (process.settings.timeout, process.settings.first_timeout) == (300.0, 600.0)
        assert process.settings.watching and process.settings.on
        process.configure(0, "off", joined=False)
        assert not process.settings.watching and not process.settings.on
    finally:
        jaxcoll._watch.configure(0, "off")


class _Pending:
    """A stand-in for a dispatched call's output: ready once ``finish`` is called."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.ready = log, name, False

    def is_deleted(self) -> bool:
        return False

    def is_ready(self) -> bool:
        return self.ready

    def block_until_ready(self):
        self.log.append(f"waited {self.name}")
        self.ready = True
        return self


def test_the_bound_waits_for_the_oldest_call(monkeypatch):
    # (XLA:CPU's own dispatch may block first, so the queue is driven with stand-ins.)
    monkeypatch.setattr(_inflight, "_first", lambda tree: tree)
    monkeypatch.setattr(_inflight, "_limit", 3)
    monkeypatch.setattr(_inflight, "_queue", collections.deque())
    log: list[str] = []
    calls = [_Pending(log, str(i)) for i in range(6)]
    for i, call in enumerate(calls):
        _inflight.admit(call)
        log.append(f"admitted {i}")
        assert _inflight.in_flight() <= 2  # the next dispatch makes 3 in flight, no more
    assert log == [
        "admitted 0",
        "admitted 1",
        "waited 0",  # the 3rd call waits for the oldest before it returns
        "admitted 2",
        "waited 1",
        "admitted 3",
        "waited 2",
        "admitted 4",
        "waited 3",
        "admitted 5",
    ]
    calls[4].ready = calls[5].ready = True  # finished ones are dropped without a wait
    _inflight.admit(_Pending(log, "6"))
    assert _inflight.in_flight() == 1 and log[-1] == "admitted 5"


def test_real_calls_stay_within_the_bound(monkeypatch):
    monkeypatch.setenv("JAXCOLL_MAX_INFLIGHT", "2")
    _inflight.reset()
    try:
        x = dist.per_rank(lambda r: np.full((256,), float(r), np.float32))
        for _ in range(10):
            y = dist.all_reduce(x)
            assert _inflight.in_flight() <= 1
        assert dist.to_ranks(y)[0][0] == 28.0
    finally:
        monkeypatch.delenv("JAXCOLL_MAX_INFLIGHT")
        _inflight.reset()


def test_default_bounds_per_backend_and_a_bad_setting(monkeypatch):
    monkeypatch.delenv("JAXCOLL_MAX_INFLIGHT", raising=False)
    # XLA:CPU deadlocked with 8 devices on 2, 4 and 8 cores, never on 16.
    assert [_inflight.limit("cpu", 8, cores) for cores in (2, 8, 15, 16)] == [8, 8, 8, 256]
    assert _inflight.limit("gpu", 1, 2) == 256
    monkeypatch.setenv("JAXCOLL_MAX_INFLIGHT", "0")
    assert _inflight.limit("cpu", 8, 2) == 0
    monkeypatch.setenv("JAXCOLL_MAX_INFLIGHT", "many")
    with pytest.raises(ValueError, match=r"JAXCOLL_MAX_INFLIGHT='many' is not a count of calls"):
        _inflight.limit("cpu", 8, 2)
