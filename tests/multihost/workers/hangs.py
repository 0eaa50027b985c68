"""Jobs that would hang, answer wrongly or ignore SIGTERM without jaxcoll's guards.

Usage: ``hangs.py OUT MODE`` under ``jaxcoll-run --nprocs 2 --devices-per-proc 2`` (the
launcher's ``--timeout`` / ``--debug`` set ``JAXCOLL_TIMEOUT`` / ``JAXCOLL_DEBUG``); MODE
``bind`` is started with torchrun's variables instead. Every process writes its pid to
``OUT/pid{k}`` and, once in its loop, ``OUT/loop{k}``.

Modes (process 0 / process 1):
  ``op``: ``dist.all_reduce`` / ``dist.all_gather`` of the same array.
  ``src``: ``dist.broadcast(src=0)`` / ``dist.broadcast(src=3)``.
  ``dtype``: ``dist.all_reduce`` of float32 / of int32, same shape.
  ``shape``: ``dist.all_reduce`` of ``[4, 3]`` / ``[4, 5]`` rows.
  ``spin``: a ``jaxcoll.watch``-ed jitted shard_map of the user's / a Python loop.
  ``exit``: ``dist.all_reduce`` / ``sys.exit(0)``.
  ``fail0``: ``raise SystemExit("...")`` once process 1 is in its loop / ``dist.all_reduce``.
  ``apart``: both ``dist.all_reduce``, then process k sleeps ``3 * k`` s (``apart1``:
  ``3 * (1 - k)`` s) before its normal exit.
  ``once``: both ``dist.all_reduce`` once, print the result and exit at once (a clean job).
  ``block``: waits in ``dist.all_reduce`` / sleeps in Python (the test sends SIGTERM).
  ``second``: both ``dist.all_reduce`` once; then process 0 all-reduces again while process
  1 sleeps 30 s (the second call of a program that completed: the short timeout).
  ``preempt``: both loop on all-reduces inside ``jaxcoll.handle_preemption`` and stop at
  ``jaxcoll.preemption_point`` (the test sends SIGTERM to process 1 only).
  ``bind``: process 0 writes the addresses listening on the coordinator port to ``OUT/listen``.
  ``cost``: prints what mismatch detection costs (docs/benchmarks.md), not a test.
"""

import dataclasses
import os
import sys
import time

OUT, MODE = sys.argv[1], sys.argv[2]

import jaxcoll  # noqa: E402
from jaxcoll import distributed as dist  # noqa: E402

jaxcoll.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ME = jax.process_index()
with open(os.path.join(OUT, f"pid{ME}"), "w") as fh:
    fh.write(str(os.getpid()))


def mark(name: str) -> None:
    with open(os.path.join(OUT, f"{name}{ME}"), "w") as fh:
        fh.write("reached")


def rows(width: int = 3, dtype=np.float32):
    return dist.per_rank(lambda r: np.full((width,), r + 1, dtype))


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net shows them) with a TCP listener on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:
                found.append(addr)
    return found


x = rows()
if MODE == "op":
    y = dist.all_reduce(x) if ME == 0 else dist.all_gather(x)
elif MODE == "src":
    y = dist.broadcast(x, src=0 if ME == 0 else 3)
elif MODE == "dtype":
    y = dist.all_reduce(rows(3, np.float32 if ME == 0 else np.int32))
elif MODE == "shape":
    y = dist.all_reduce(rows(3 if ME == 0 else 5))
elif MODE == "spin":
    world = dist.world()
    spec = P(world.mesh_axes)
    step = jaxcoll.watch(
        jax.jit(
            jax.shard_map(
                lambda v: jaxcoll.primitives.all_reduce(v, world.axis_name),
                mesh=world.mesh,
                in_specs=spec,
                out_specs=spec,
            )
        ),
        name="user step",
    )
    if ME == 1:
        mark("loop")
        while True:  # alive, heartbeating, and in no collective
            pass
    y = step(x)
elif MODE == "exit":
    if ME == 1:
        sys.exit(0)
    y = dist.all_reduce(x)
elif MODE == "fail0":
    if ME == 0:
        while not os.path.exists(os.path.join(OUT, "loop1")):
            time.sleep(0.05)
        time.sleep(0.5)  # process 1 is now inside the all-reduce
        raise SystemExit("hangs.py: process 0 gives up on purpose")
    mark("loop")
    y = dist.all_reduce(x)
elif MODE in ("apart", "apart1"):
    y = dist.all_reduce(x)
    print(f"process {ME} result {dist.to_ranks(y)[0]}", flush=True)
    time.sleep(3 * (ME if MODE == "apart" else 1 - ME))
    sys.exit(0)
elif MODE == "once":
    y = dist.all_reduce(x)
elif MODE == "block":
    mark("loop")
    if ME == 1:
        time.sleep(3600)
    y = dist.all_reduce(x)
elif MODE == "second":
    dist.to_ranks(dist.all_reduce(x))  # completes on both
    if ME == 1:
        time.sleep(30)
    y = dist.all_reduce(x)
elif MODE == "preempt":
    with jaxcoll.handle_preemption():
        for i in range(10**6):
            if i == 3:
                mark("loop")
            y = dist.all_reduce(x)
            dist.to_ranks(y)  # each step's result read: the processes stay in step
            time.sleep(0.01)
            if jaxcoll.preemption_point(i):
                print(f"process {ME} stops after step {i}", flush=True)
                sys.exit(128 + 15)
elif MODE == "bind":
    if ME == 0:
        with open(os.path.join(OUT, "listen"), "w") as fh:
            fh.write(" ".join(listening(int(os.environ["MASTER_PORT"]))))
    y = dist.all_reduce(x)
elif MODE == "cost":
    from jaxcoll import _watch
    from jaxcoll.distributed import _collectives

    spent = {"check": [], "agree": []}

    def timed(fn, into):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[into].append(time.perf_counter() - t0)

        return wrapper

    _collectives._agree_first_use = timed(_collectives._agree_first_use, "check")
    _watch.detect.agree = timed(_watch.detect.agree, "agree")

    def first_call(width: int) -> float:
        """Seconds for the first call of a new all_reduce program (a new shape), waited."""
        z = rows(width)
        t0 = time.perf_counter()
        jax.block_until_ready(dist.all_reduce(z))
        return time.perf_counter() - t0

    def cached(n: int) -> tuple[float, float]:
        """Median microseconds of a cached dist.all_reduce dispatch (not waited), without and
        with detection, interleaved."""
        z = rows(8)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(2 * n):
            now = _watch.process.settings
            _watch.process.settings = dataclasses.replace(now, detail=bool(i % 2))
            t0 = time.perf_counter()
            out = dist.all_reduce(z)
            times[bool(i % 2)].append(time.perf_counter() - t0)
            jax.block_until_ready(out)
        return tuple(float(np.median(times[k])) * 1e6 for k in (False, True))

    first = {"off": [], "detail": []}
    for w in range(20):  # interleaved: machine noise hits both alike
        for debug in ("off", "detail"):
            _watch.configure(0, debug)
            first[debug].append(first_call(1000 + 2 * w + (debug == "detail")))
    _watch.configure(0, "detail")
    plain, checked = cached(400)
    if ME == 0:
        off, on = (float(np.median(first[k])) * 1e3 for k in ("off", "detail"))
        check = float(np.median(spent["check"][:20])) * 1e3
        agree = float(np.median(spent["agree"])) * 1e3
        print(
            f"first call of a program (median of 20): {off:.1f} ms without detection, "
            f"{on:.1f} ms with it; the check itself {check:.1f} ms, of which the key-value "
            f"exchange {agree:.1f} ms and lowering + hashing {check - agree:.1f} ms"
        )
        print(
            f"cached call (median of 400): {plain:.1f} us without detection, {checked:.1f} us "
            f"with it"
        )
    _watch.configure(0, "off")
    y = dist.all_reduce(x)
else:
    raise SystemExit(f"hangs.py: unknown mode {MODE!r}")

print(f"process {ME} result {dist.to_ranks(y)[0]}", flush=True)
