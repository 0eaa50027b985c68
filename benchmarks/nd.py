"""The GPT example (examples/gpt.py) in every layout: step time, tokens/s, MFU, memory, and
the same model the plain JAX way (GSPMD).

    .venv/bin/python benchmarks/nd.py                       # the default run (~3 min)
    .venv/bin/python benchmarks/nd.py --width 128 --rounds 3

8 simulated CPU devices. The model is examples/gpt.py's (its default size, or ``--width`` /
``--layers``), trained by its AdamW recipe on one fixed global batch, without accumulation
(``ACCUM = 1`` here, so that every row runs the same program shape). Rows:

- jaxcoll: ``gpt.trainer_for(layout)`` for dp8, fsdp8, dp2xfsdp4, fsdp4xtp2, dp2xtp2xpp2,
  fsdp2xtp2xpp2 (and ``single``: one device);
- GSPMD: what a user writes in plain JAX: ``jax.jit`` of value_and_grad + the same optax
  update, params and optimizer state placed by ``NamedSharding``, the batch split over
  ``data``: ``gspmd fsdp8`` (each leaf split over 8 along the dimension jaxcoll's FSDP
  picks) and ``gspmd fsdp4xtp2`` (each leaf split over ``tensor`` as its flax boxes say and
  over ``data`` along another dimension). The model runs dense under plain jit (no mesh axis
  is bound), and XLA's SPMD partitioner splits it.

Columns: ``ms`` the median step time (each step waited for; ``--rounds`` rounds, each timing
``--steps`` steps of every row in turn, A, B, C, ..., so load from other processes hits all
rows alike); ``tok/s`` = batch x context / step time; ``GFLOP`` the compiled step's
``cost_analysis()["flops"]`` (XLA:CPU reports the per-device program's; summed over the 8
devices here for the SPMD rows); ``MFU`` = GFLOP / time over the peak; ``MiB`` per-device
``argument + temp`` bytes of the compiled step (``memory_analysis()``); ``diff`` the largest
relative difference of the params from the single-device run after the same steps.

The peak: a 1024 x 1024 float32 matmul on each of the 8 simulated devices at once (one
``shard_map``), timed as the rows are: the machine's aggregate float32 rate (the 8 simulated
devices share its cores, so one device's matmul rate would overstate the peak 8 times).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll.dp.layout import merge, restrict, used_dims  # noqa: E402
from jaxcoll.dp.sync.base import mirror_specs  # noqa: E402
from jaxcoll.dp.sync.fsdp import fsdp_dim  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--width", type=int, default=None, help="model width (default: gpt's)")
parser.add_argument("--layers", type=int, default=None, help="blocks (default: gpt's)")
parser.add_argument("--steps", type=int, default=4, help="steps per row per round")
parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the rows")
args = parser.parse_args()

spec = importlib.util.spec_from_file_location(
    "gpt_example", Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
)
gpt = importlib.util.module_from_spec(spec)
sys.argv = sys.argv[:1]
spec.loader.exec_module(gpt)
gpt.ACCUM = 1
if args.width:
    gpt.WIDTH = args.width
if args.layers:
    gpt.LAYERS = args.layers

LAYOUTS = ["single", "dp8", "fsdp8", "dp2xfsdp4", "fsdp4xtp2", "dp2xtp2xpp2", "fsdp2xtp2xpp2"]
BATCH = next(gpt.batches("train", 1, seed=1))


def memory_mib(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes) / 2**20


def flops(compiled, devices: int) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)) * devices


def row_jaxcoll(name: str):
    trainer = gpt.trainer_for(name)
    state = trainer.init(gpt.init_params(), jax.random.key(0))
    step, abstract = trainer.step_program(state, BATCH)
    compiled = step.lower(*abstract).compile()
    batch = trainer.shard_batch(BATCH)
    devices = trainer.mesh.devices.size

    def run(state):
        return trainer.step(state, batch)[0]

    def params(state):
        return trainer.host_params(state)

    return state, run, params, memory_mib(compiled), flops(compiled, devices)


def row_gspmd(shape: tuple[int, ...], names: tuple[str, ...]):
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    boxed = gpt.init_params()
    params = nn.meta.unbox(boxed)
    model = jax.tree.leaves(nn.get_partition_spec(boxed), is_leaf=lambda s: isinstance(s, P))
    n = mesh.shape["data"]
    leaves, treedef = jax.tree.flatten(params)
    specs = []
    for x, m in zip(leaves, model, strict=True):
        m = restrict(m, tuple(names))
        specs.append(merge(m, fsdp_dim(x.shape, n, used_dims(m)), "data"))
    p_sh = jax.tree.unflatten(treedef, [NamedSharding(mesh, s) for s in specs])
    opt = gpt.optimizer()
    o_sh = jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        mirror_specs(jax.eval_shape(opt.init, params), params, jax.tree.unflatten(treedef, specs)),
        is_leaf=lambda s: isinstance(s, P),
    )
    b_sh = NamedSharding(mesh, P("data"))

    def step(params, opt_state, batch):
        loss, g = jax.value_and_grad(lambda p: gpt.loss_fn(p, batch, None)[0])(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return jax.tree.map(jnp.add, params, updates), opt_state, loss

    step = jax.jit(
        step,
        in_shardings=(p_sh, o_sh, b_sh),
        out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )
    placed = jax.device_put(params, p_sh)
    state = (placed, jax.jit(opt.init, out_shardings=o_sh)(placed))
    batch = jax.device_put(BATCH, b_sh)
    compiled = step.lower(*state, batch).compile()

    def run(state):
        return step(*state, batch)[:2]

    def host(state):
        return jax.device_get(state[0])

    return state, run, host, memory_mib(compiled), flops(compiled, mesh.devices.size)


def peak_flops() -> float:
    """FLOP/s of a 1024^3 float32 matmul on all 8 simulated devices at once (median of 5)."""
    k = 1024
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    a = jax.device_put(jnp.ones((8 * k, k), jnp.float32), NamedSharding(mesh, P("d")))
    mm = jax.jit(
        jax.shard_map(lambda x: x @ x.T[:, :k], mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )
    jax.block_until_ready(mm(a))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(mm(a))
        times.append(time.perf_counter() - t)
    return 8 * 2 * k**3 / statistics.median(times)


def main() -> None:
    print(
        f"GPT: {gpt.LAYERS} blocks, width {gpt.WIDTH}, {gpt.HEADS} heads, context {gpt.BLOCK}, "
        f"batch {gpt.BATCH} sequences; jax {jax.__version__}, {len(jax.devices())} simulated "
        f"CPU devices on {os.cpu_count()} cores"
    )
    peak = peak_flops()
    print(
        f"peak: {peak / 1e9:.1f} GFLOP/s (a 1024^3 float32 matmul on each of the 8 devices at once)"
    )
    rows = {name: row_jaxcoll(name) for name in LAYOUTS}
    rows["gspmd fsdp8"] = row_gspmd((8,), ("data",))
    rows["gspmd fsdp4xtp2"] = row_gspmd((4, 2), ("data", "tensor"))
    states = {k: r[0] for k, r in rows.items()}
    for k, r in rows.items():  # compile and warm up
        states[k] = jax.block_until_ready(r[1](states[k]))
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.rounds):
        for k, r in rows.items():
            for _ in range(args.steps):
                t = time.perf_counter()
                states[k] = jax.block_until_ready(r[1](states[k]))
                times[k].append(time.perf_counter() - t)
    steps = 1 + args.rounds * args.steps
    reference = jax.tree.leaves(rows["single"][2](states["single"]))
    tokens = gpt.BATCH * gpt.BLOCK
    print(
        f"\nmedian of {args.rounds} interleaved rounds x {args.steps} steps; every row "
        f"took {steps} steps on the same batch\n"
    )
    print(
        "| layout | ms/step | tokens/s | GFLOP/step | MFU % | args+temp MiB/device | max rel diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k, r in rows.items():
        ms = 1e3 * statistics.median(times[k])
        got = jax.tree.leaves(r[2](states[k]))
        diff = max(
            float(np.max(np.abs(np.asarray(a) - b)) / (np.max(np.abs(b)) + 1e-12))
            for a, b in zip(got, reference, strict=True)
        )
        gflop = r[4] / 1e9
        mfu = 100 * r[4] / (ms / 1e3) / peak
        print(
            f"| {k} | {ms:.1f} | {tokens / (ms / 1e3):,.0f} | {gflop:.3f} | {mfu:.2f} | "
            f"{r[3]:.2f} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main()
