"""Many async collectives in flight on 8 simulated devices of one process, for XLA:CPU's timeouts.

Usage::

    python benchmarks/rendezvous_stress.py [--rounds 40] [--burners 2] [--in-flight 12]

XLA:CPU runs each simulated device's part of a collective on its own thread and joins them at
a rendezvous. On a loaded machine a thread can arrive late; XLA:CPU's default then ends the
process with a C++ check failure after 40 s (``rendezvous.cc ... Termination timeout``), before
any jaxcoll message. This script issues ``--rounds`` rounds of async ``dist.all_reduce`` (1M
float32 per rank), ``dist.all_gather`` and ``dist.broadcast`` with at most ``--in-flight`` pending,
while ``--burners`` CPU-bound processes compete for the cores, and checks every result against
NumPy. It exits 0 when all rounds finish and agree. The device setup is jaxcoll's
(:func:`jaxcoll.xla_cpu_flags`), so this shows what that setting buys; with
``--xla-default`` the process keeps XLA's own timeouts instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--burners", type=int, default=2)
    p.add_argument("--in-flight", type=int, default=12)
    p.add_argument("--elements", type=int, default=1 << 20)
    p.add_argument(
        "--xla-default",
        action="store_true",
        help="keep XLA:CPU's own rendezvous timeouts (to see its abort)",
    )
    a = p.parse_args()

    import jaxcoll

    flags = ["--xla_force_host_platform_device_count=8"]
    if not a.xla_default:
        flags = jaxcoll.xla_cpu_flags(devices=8)
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import numpy as np

    from jaxcoll import distributed as dist

    burner = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"
    burners = [
        subprocess.Popen([sys.executable, "-c", burner])  # end with this process
        for _ in range(a.burners)
    ]
    try:
        t0 = time.monotonic()
        x = dist.per_rank(lambda r: np.full((a.elements,), r + 1.0, np.float32))
        small = dist.per_rank(lambda r: np.arange(4, dtype=np.float32) + r)
        pending = []
        for i in range(a.rounds):
            pending.append(("sum", dist.all_reduce(x, async_op=True)))
            pending.append(("gather", dist.all_gather(small, async_op=True)))
            pending.append(("bcast", dist.broadcast(small, src=i % 8, async_op=True), i % 8))
            while len(pending) > a.in_flight:
                _check(pending.pop(0), a.elements)
        for item in pending:
            _check(item, a.elements)
        print(
            f"{a.rounds} rounds, {a.burners} burners: all results agree with NumPy in "
            f"{time.monotonic() - t0:.1f} s",
            flush=True,
        )
    finally:
        for b in burners:
            b.kill()


def _check(item, elements: int) -> None:
    import numpy as np

    from jaxcoll import distributed as dist

    kind, work = item[0], item[1]
    got = dist.to_ranks(work.wait())
    if kind == "sum":
        want = np.full((8, elements), 36.0, np.float32)
    elif kind == "gather":
        want = np.broadcast_to(
            np.arange(4, dtype=np.float32)[None, None]
            + np.arange(8.0, dtype=np.float32)[None, :, None],
            (8, 8, 4),
        )
    else:
        want = np.broadcast_to(np.arange(4, dtype=np.float32) + item[2], (8, 4))
    np.testing.assert_array_equal(got, want, err_msg=kind)


if __name__ == "__main__":
    main()
