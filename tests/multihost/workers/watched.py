"""A ``jaxcoll.watch``-ed program that differs between the processes.

Usage: ``watched.py`` under ``jaxcoll-run --nprocs 2 --debug detail``. Both processes wrap a
jitted shard_map over all devices with ``jaxcoll.watch(..., name="user step")`` and call it
on the same shapes; process 0's program sums over the devices, process 1's takes the maximum.
Only the hash of the lowered program tells them apart: mismatch detection must raise on both
before the programs run (without it, the two all-reduces meet in gloo and return garbage, or
hang). Each process prints ``process K result ...`` if its call returned.
"""

import jaxcoll

jaxcoll.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ME = jax.process_index()
mesh = Mesh(np.array(jax.devices()), ("x",))
local = np.full((jax.local_device_count(), 3), ME + 1, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
reduce = jax.lax.psum if ME == 0 else jax.lax.pmax
step = jaxcoll.watch(
    jax.jit(jax.shard_map(lambda v: reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())),
    name="user step",
)
y = step(x)
print(f"process {ME} result {np.asarray(y.addressable_data(0)).tolist()}", flush=True)
