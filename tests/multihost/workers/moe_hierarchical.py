"""parallel.moe_mlp with the flat and the hierarchical exchange over a (node, local) mesh whose
node axis spans the processes: both steps' outputs and gradients, and the bytes each
compiled step brings a device from the other process.

Run under the launcher, as 2 processes x 4 devices::

    python -m jaxcoll.run --nprocs 2 --devices-per-proc 4 \
        tests/multihost/workers/moe_hierarchical.py OUT

Process 0 writes ``OUT/result.npz``: for each of ``flat`` and ``hier``, the layer's output
``{name}/y`` and the gradients ``{name}/g0..g3`` (x, router, w_in, w_out; whole arrays,
gathered from both processes) and ``{name}/cross`` (bytes per device from the other process,
all collectives of the compiled step), plus ``inputs/*``, the inputs.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))

import jaxcoll  # noqa: E402

WORLD = jaxcoll.init()  # before any other JAX call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.moe_hierarchical import cross_process_bytes  # noqa: E402
from jaxcoll import parallel  # noqa: E402

E, D, H, K, B, S = 16, 8, 12, 3, 8, 6  # tests/parallel/test_moe_hierarchical.py's oracle's
AX = ("node", "local")
SPECS = (P(AX), P(), P(AX), P(AX))


def inputs():
    """The global inputs, the same in every process (NumPy, seeded)."""
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((B, S, D)).astype(np.float32),
        rng.standard_normal((D, E)).astype(np.float32),
        (rng.standard_normal((E, D, H)) / np.sqrt(D)).astype(np.float32),
        (rng.standard_normal((E, H, D)) / np.sqrt(H)).astype(np.float32),
    )


def step(mesh, hierarchical):
    def grads(x, router, w_in, w_out):
        def loss(x, router, w_in, w_out):
            y, _ = parallel.moe_mlp(
                x, router, w_in, w_out, k=K, axis_name=AX, hierarchical=hierarchical
            )
            return jnp.sum(y**2) / (B * S * D), y

        router = jax.lax.pcast(router, AX, to="varying")
        (_, y), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            x, router, w_in, w_out
        )
        return y, g[0], jax.lax.psum(g[1], AX), g[2], g[3]

    out_specs = (P(AX), P(AX), P(), P(AX), P(AX))
    return jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=SPECS, out_specs=out_specs))


def main(out_dir):
    devices = np.array(jax.devices()).reshape(2, 4)  # global order: process 0's devices first
    assert [d.process_index for d in devices[:, 0]] == [0, 1], devices
    mesh = Mesh(devices, AX)
    local = {d.id for d in jax.local_devices()}
    flat_devices = list(mesh.devices.flat)
    args = inputs()
    placed = []
    for a, spec in zip(args, SPECS):
        sharding = NamedSharding(mesh, spec)
        if spec == P():
            placed.append(jax.make_array_from_process_local_data(sharding, a))
            continue
        per = a.shape[0] // 8
        rows = [i for i, d in enumerate(flat_devices) if d.id in local]
        mine = np.concatenate([a[i * per : (i + 1) * per] for i in rows])
        placed.append(jax.make_array_from_process_local_data(sharding, mine))
    process = [d.process_index for d in flat_devices]
    results = {f"inputs/{i}": a for i, a in enumerate(args)}
    for name, hier in (("flat", False), ("hier", True)):
        fn = step(mesh, hier)
        text = fn.lower(*placed).compile().as_text()
        results[f"{name}/cross"] = np.asarray(sum(cross_process_bytes(text, process).values()))
        y, *grads = fn(*placed)
        results[f"{name}/y"] = multihost_utils.process_allgather(y, tiled=True)
        for i, g in enumerate(grads):
            results[f"{name}/g{i}"] = multihost_utils.process_allgather(g, tiled=True)
    if jax.process_index() == 0:
        flat, hier = float(results["flat/cross"]), float(results["hier/cross"])
        print(f"bytes per device from the other process: flat {flat:.0f}, hier {hier:.0f}")
        os.makedirs(out_dir, exist_ok=True)
        np.savez(os.path.join(out_dir, "result.npz"), **results)
    print(f"process {jax.process_index()}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
