"""What the flight recorder costs a call: the recording itself, and a dist call with it on and off.

Every dist call, Trainer step and jaxcoll.watch-ed call is recorded (jaxcoll._watch.recorder)
when the watchdog is on or the process is in a multi-process job. This prints the median of
the recording alone (watchdog.register: the ring buffer entry, the call site, the group's
sequence number, the append to the watchdog's deque) and of a cached dist.all_reduce dispatch
(not waited for) with the recorder off and on, measured interleaved (off, on, off, on, ...)
so machine noise hits both alike.

Run:  python benchmarks/flight_recorder.py [--repeats 2000]   (8 CPU devices)
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxcoll import _watch  # noqa: E402
from jaxcoll import distributed as dist  # noqa: E402
from jaxcoll._watch import watchdog  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    x = dist.per_rank(lambda r: np.full((256,), r, np.float32))
    jax.block_until_ready(dist.all_reduce(x))  # compiled once

    _watch.configure(600, "off")
    alone = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        watchdog.register(x, "dist.all_reduce", x, "op=SUM")
        alone.append(time.perf_counter() - t0)
    jax.block_until_ready(x)

    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * args.repeats):
        on = bool(i % 2)
        _watch.configure(600 if on else 0, "off")
        t0 = time.perf_counter()
        out = dist.all_reduce(x)
        times[on].append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    _watch.configure(0, "off")

    off, on = (statistics.median(times[k]) * 1e6 for k in (False, True))
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices, {args.repeats} calls each")
    print("| what | median us |")
    print("|---|---:|")
    print(f"| recording one call (watchdog.register) | {statistics.median(alone) * 1e6:.2f} |")
    print(f"| dist.all_reduce dispatch, recorder off | {off:.1f} |")
    print(f"| dist.all_reduce dispatch, recorder on | {on:.1f} |")
    print(f"| difference | {on - off:+.1f} |")


if __name__ == "__main__":
    main()
