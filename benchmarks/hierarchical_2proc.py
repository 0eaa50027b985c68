"""Flat vs hierarchical all-reduce over 2 processes x 4 simulated CPU devices (gloo).

Starts two copies of ``jaxcoll-bench`` on 127.0.0.1 with ``jax.distributed`` and prints
process 0's table. Run::

    .venv/bin/python benchmarks/hierarchical_2proc.py --max-bytes 16M

Extra arguments go to ``jaxcoll-bench`` (defaults: all_reduce, native,hierarchical, 4K..16M).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = sys.argv[1:]
    args = [
        "--ops",
        "all_reduce",
        "--algorithms",
        "native,hierarchical",
        "--devices",
        "4",
        "--iters",
        "5",
        "--no-progress",
        *extra,
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxcoll.bench",
                *args,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(pid),
            ],
            env=env,
            stderr=subprocess.DEVNULL if pid else None,
        )
        for pid in range(2)
    ]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    raise SystemExit(main())
