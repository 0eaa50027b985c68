"""Seed 002, "how to correctly average gradients across GPUs", ported to JAX and checked.

    python examples/04_average_gradients.py        # 8 simulated CPU devices, a few seconds

The seed's three torch variants, written as a JAX user would port them inside
``jax.shard_map``, next to jaxcoll's, each compared with the gradient one device computes on
the whole batch (the oracle). Printed: the ratio |g| / |oracle| and the max relative error.

1. ``all_reduce(grad, SUM)`` then ``/= world_size``: right in torch. Ported naively
   (``jax.grad`` on replicated params) it is 8x too large: ``jax.grad`` already summed over
   devices, and the all-reduce of an already-replicated value multiplies by 8 again before the
   division. With params made varying first (``lax.pcast``) it is right.
2. The same with ``clone()`` first: the clone changes nothing (the seed's claim that it makes
   "different shapes" work is wrong: every rank must pass the same shape). Right, if 1 is.
3. Averaging over a sub-group (here the 4 devices of one "node" on a 2x4 mesh): each group
   gets its own mean, the replicas drift apart. Wrong for data parallelism over all devices.
jaxcoll: ``dp.mean_gradients`` (what ``dp.Trainer`` runs) averages exactly once.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll.primitives as C  # noqa: E402
from jaxcoll import dp  # noqa: E402


def loss(w, x):
    """Per-example mean loss on whatever batch this device holds."""
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def main() -> None:
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(6,)), jnp.float32)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    oracle = np.asarray(jax.grad(loss)(w, x))  # one device, whole batch

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("node", "local"))
    both = ("node", "local")

    def body(w, xb):
        n = C.world_size(both)
        naive = C.all_reduce(jax.grad(loss)(w, xb), both, "sum") / n  # 1, ported naively
        wv = lax.pcast(w, both, to="varying")  # the fix: jax.grad adds no reduction of its own
        g = jax.grad(loss)(wv, xb)
        ex1 = C.all_reduce(g, both, "sum") / n  # 1, fixed
        ex2 = C.all_reduce(jnp.array(g, copy=True), both, "sum") / n  # 2, clone first
        ex3 = C.all_reduce(g, "local", "sum") / C.world_size("local")  # 3, a sub-group
        ours = dp.mean_gradients(g, both, bucket_bytes=25 * 2**20)  # jaxcoll
        # every device's copy, to show whether the replicas agree
        return [v[None] for v in (naive, ex1, ex2, ex3, ours)]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(both)), out_specs=P(both)))
    results = f(w, jax.device_put(x, NamedSharding(mesh, P(both))))

    names = [
        "1. all_reduce(SUM) / n, naive port",
        "1. all_reduce(SUM) / n, params varying",
        "2. clone, all_reduce(SUM) / n",
        "3. sub-group average (4 of 8)",
        "jaxcoll dp.mean_gradients",
    ]
    print(f"oracle (one device, whole batch of {len(x)}): |g| = {np.linalg.norm(oracle):.6f}")
    print(f"{'variant':42s} {'|g|/|oracle|':>13s} {'max rel err':>12s} {'replicas':>9s}  verdict")
    for name, per_device in zip(names, results, strict=True):
        per_device = np.asarray(per_device)
        agree = all(np.array_equal(per_device[0], d) for d in per_device)
        worst = max(np.max(np.abs(d - oracle)) / np.max(np.abs(oracle)) for d in per_device)
        ratio = np.linalg.norm(per_device[0]) / np.linalg.norm(oracle)
        verdict = "RIGHT" if worst < 1e-5 and agree else "WRONG"
        print(
            f"{name:42s} {ratio:13.4f} {worst:12.2e} {'same' if agree else 'DIFFER':>9s}  {verdict}"
        )


if __name__ == "__main__":
    main()
