"""Pipeline parallelism (GPipe) on send/recv, composed with data parallelism: 2 x 4 devices.

    python examples/06_pipeline.py        # 8 simulated CPU devices, a few seconds

A 4-layer tanh MLP is cut into 4 stages, one per device along the mesh axis "stage"; a second
axis "data" holds 2 replicas, each with half of every global batch. Each step splits a
replica's 32 examples into 8 micro-batches: forward, stage s runs micro-batch t - s at step t
and sends its activation to stage s + 1 (``sendrecv``: one ppermute); backward, the
cotangents travel the other way and each stage accumulates its gradient over the 8
micro-batches; the replicas average their gradients once; every stage takes an SGD step on
its own layer. The same model trained on one device on the whole batches must give the same
losses and parameters (within 1e-5). Seed 003 says send/recv are for pipelines: here they are.
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
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import parallel  # noqa: E402

DATA, STAGES = 2, 4  # 2 replicas x 4 pipeline stages = 8 devices
MICROBATCHES = 8  # per replica and step
SCHEDULE = parallel.GPipe(MICROBATCHES)  # a value; it also gives the bubble printed below
BATCH = 64  # global batch: 32 per replica, 4 per micro-batch
WIDTH = 16
STEPS, LR = 10, 0.2

rng = np.random.default_rng(0)
params = {
    "w": (rng.normal(size=(STAGES, WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
    "b": np.zeros((STAGES, WIDTH), np.float32),
}
teacher = rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) / np.sqrt(WIDTH)
batches = []
for _ in range(STEPS):
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    batches.append((x, np.tanh(x @ teacher)))


def stage_fn(p, h):
    """One stage = one layer; every stage keeps the activation's shape."""
    return jnp.tanh(h @ p["w"] + p["b"])


def loss_fn(h, y):
    return jnp.mean((h - y) ** 2)


def pipeline_step(params, x, y):
    """One device: params of its stage, x/y its replica's half of the batch."""
    mine = jax.tree.map(lambda a: a[0], params)
    loss, grads = parallel.pipeline_value_and_grad(
        stage_fn,
        loss_fn,
        mine,
        x,
        y,
        axis_name="stage",
        schedule=SCHEDULE,
        data_axis_name="data",
    )
    new = jax.tree.map(lambda p, g: p - LR * g, mine, grads)
    return jax.tree.map(lambda a: a[None], new), loss


mesh = Mesh(np.array(jax.devices()).reshape(DATA, STAGES), ("data", "stage"))
step = jax.jit(
    jax.shard_map(
        pipeline_step,
        mesh=mesh,
        in_specs=(P("stage"), P("data"), P("data")),
        out_specs=(P("stage"), P()),
    )
)


@jax.jit
def reference_step(params, x, y):
    """The same model on one device, the whole batch at once."""

    def model_loss(p):
        h = x
        for s in range(STAGES):
            h = stage_fn(jax.tree.map(lambda a, s=s: a[s], p), h)
        return loss_fn(h, y)

    loss, grads = jax.value_and_grad(model_loss)(params)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


piped = jax.device_put(params, NamedSharding(mesh, P("stage")))
single = params
worst = 0.0
for i, (x, y) in enumerate(batches):
    piped, loss = step(
        piped,
        jax.device_put(x, NamedSharding(mesh, P("data"))),
        jax.device_put(y, NamedSharding(mesh, P("data"))),
    )
    single, ref_loss = reference_step(single, x, y)
    diff = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(piped), jax.tree.leaves(single))
    )
    worst = max(worst, diff, abs(float(loss) - float(ref_loss)))
    if i % 3 == 0 or i == STEPS - 1:
        print(
            f"step {i}: pipeline loss {float(loss):.6f}  single-device loss "
            f"{float(ref_loss):.6f}  max param difference {diff:.1e}"
        )

bubble = SCHEDULE.bubble_fraction(STAGES)
print(
    f"{DATA} data x {STAGES} stages, {MICROBATCHES} micro-batches per step: bubble fraction "
    f"(S-1)/(M+S-1) = {STAGES - 1}/{MICROBATCHES + STAGES - 1} = {bubble:.3f}"
)
print(
    f"pipeline equal to single-device training (1e-5): {worst <= 1e-5} "
    f"(max difference {worst:.1e} over {STEPS} SGD steps)"
)
