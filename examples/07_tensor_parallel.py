"""Tensor parallelism: a Megatron MLP block split over 4 devices, equal to the dense block.

    python examples/07_tensor_parallel.py        # 4 simulated CPU devices, a few seconds

``gelu(x @ W1 + b1) @ W2 + b2`` with W1 split by columns and W2 by rows over the mesh axis
"model": each device computes a quarter of the hidden units with no communication, and ONE
all_reduce sums the partial outputs. With sequence parallelism the tokens stay split over the
devices between blocks, and the pair becomes one all_gather before and one reduce_scatter
after. Output and gradients (of every weight and of the input) must equal the dense block on
one device; the compiled programs are counted for their collectives.
"""

from __future__ import annotations

import os
import re

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import parallel  # noqa: E402

N = 4  # tensor-parallel ranks
TOKENS, D, F = 32, 16, 64  # tokens, model width, hidden width (F / N = 16 per rank)

rng = np.random.default_rng(0)
dense_params = {
    "w1": rng.normal(size=(D, F)).astype(np.float32) / np.sqrt(D),
    "b1": rng.normal(size=(F,)).astype(np.float32) * 0.1,
    "w2": rng.normal(size=(F, D)).astype(np.float32) / np.sqrt(F),
    "b2": rng.normal(size=(D,)).astype(np.float32) * 0.1,
}
x = rng.normal(size=(TOKENS, D)).astype(np.float32)
target = rng.normal(size=(TOKENS, D)).astype(np.float32)


def dense_block(p, x):
    return parallel.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]  # torch's nn.GELU()


mesh = Mesh(np.array(jax.devices()[:N]), ("model",))
# The params stay whole; their specs split w1 and b1 by columns, w2 by rows, b2 replicated.
split = parallel.mlp_specs(dense_params, "model")
sharded = jax.device_put(dense_params, {k: NamedSharding(mesh, s) for k, s in split.items()})


def tp_block(sequence_parallel):
    def body(p, x):  # p: this device's slices, as in_specs hands them
        return parallel.mlp(p, x, "model", sequence_parallel=sequence_parallel)

    tokens = P("model") if sequence_parallel else P()
    return jax.shard_map(body, mesh=mesh, in_specs=(split, tokens), out_specs=tokens)


def loss(block):
    return lambda p, x: jnp.mean((block(p, x) - target) ** 2)


want_y = jax.jit(dense_block)(dense_params, x)
want_g = jax.jit(jax.grad(loss(dense_block), argnums=(0, 1)))(dense_params, x)
for sp in (False, True):
    block = tp_block(sp)
    lowered = jax.jit(block).lower(sharded, x)
    y = lowered.compile()(sharded, x)
    g_params, g_x = jax.jit(jax.grad(loss(block), argnums=(0, 1)))(sharded, x)
    g_dense = {k: np.asarray(v) for k, v in want_g[0].items()}  # whole, as the params
    err_y = float(np.abs(np.asarray(y) - want_y).max())
    err_g = max(float(np.abs(np.asarray(g_params[k]) - g_dense[k]).max()) for k in g_dense)
    err_g = max(err_g, float(np.abs(np.asarray(g_x) - want_g[1]).max()))
    hlo = lowered.as_text()
    counts = {
        c: len(re.findall(rf"stablehlo\.{c}\b", hlo))
        for c in ("all_reduce", "all_gather", "reduce_scatter")
    }
    name = "sequence-parallel (all_gather + reduce_scatter)" if sp else "all_reduce"
    print(
        f"{name}: output max diff {err_y:.1e}, gradient max diff {err_g:.1e}, collectives "
        f"{ {k: v for k, v in counts.items() if v} }"
    )
    print(f"tensor-parallel block equal to dense ({name}): {err_y < 1e-5 and err_g < 1e-5}")
