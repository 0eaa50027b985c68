"""A job that fails on purpose, for the launcher's fault tests.

Usage: ``faults.py OUT MODE`` under ``jaxcoll-run --nprocs 2 --devices-per-proc 2``. Every
process writes its pid to ``OUT/pid{k}`` and, once inside its collective loop, ``OUT/loop{k}``.

MODE ``raise``: process 1 raises after a few steps while process 0 keeps calling collectives.
MODE ``loop``: both loop on collectives for a long time (the test SIGKILLs process 1).
MODE ``hang``: process 1 never calls init (sleeps), so process 0 waits for it in init.
"""

import os
import sys
import time

OUT, MODE = sys.argv[1], sys.argv[2]
ME = int(os.environ["JAXCOLL_PROCESS_ID"])
with open(os.path.join(OUT, f"pid{ME}"), "w") as fh:
    fh.write(str(os.getpid()))

if MODE == "hang" and ME == 1:
    time.sleep(3600)

import jaxcoll  # noqa: E402

jaxcoll.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("x",))
sharding = NamedSharding(mesh, P("x"))
x = jax.make_array_from_process_local_data(sharding, np.ones((jax.local_device_count(), 4)))
step = jax.jit(
    jax.shard_map(
        lambda v: jaxcoll.primitives.all_reduce(v, "x"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )
)
for i in range(100000):
    if i == 3:
        with open(os.path.join(OUT, f"loop{ME}"), "w") as fh:
            fh.write("in the collective loop")
    if MODE == "raise" and ME == 1 and i == 5:
        raise RuntimeError("worker 1 failed on purpose at step 5")
    step(x).block_until_ready()
    time.sleep(0.01)
