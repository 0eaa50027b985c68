"""The GPT example (examples/gpt.py) in every layout: step time, tokens/s, MFU, memory, and
the same model the plain JAX way (GSPMD), naive and as MaxText writes it.

    .venv/bin/python benchmarks/nd.py --hlo                 # the default run (~3 min)
    .venv/bin/python benchmarks/nd.py --width 128 --rounds 3
    .venv/bin/python benchmarks/nd.py --layouts single,fsdp8,fsdp4xtp2 --layers 8 --width 256

8 simulated CPU devices. The model is examples/gpt.py's (its default size, or ``--width`` /
``--layers``), trained by its AdamW recipe on one fixed global batch, without accumulation
(``ACCUM = 1`` here, so that every row runs the same program shape). Rows:

- jaxcoll: ``gpt.trainer_for(layout)`` for dp8, fsdp8, dp2xfsdp4, fsdp4xtp2, dp2xtp2xpp2,
  fsdp2xtp2xpp2 (and ``single``: one device); ``--layouts`` picks some;
- GSPMD: the same model, optimizer (``gpt.optimizer()``, optax) and batch in plain JAX:
  ``jax.jit`` of value_and_grad + the optax update, params and optimizer state placed by
  ``NamedSharding``, the batch split over ``data``, params and state donated:
  ``gspmd fsdp8`` (each leaf split over 8 along the dimension jaxcoll's FSDP picks) and
  ``gspmd fsdp4xtp2`` (each leaf split over ``tensor`` as its flax boxes say and over
  ``data`` along another dimension). Two ways (``--gspmd``):

  - ``naive``: ``gpt.loss_fn`` under jit, no constraint on any activation: XLA's SPMD
    partitioner picks every activation's sharding from the params';
  - ``competent``: written as MaxText writes it: the same model, with
    ``jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None, None)))`` on
    the embedding's output, on each block's output and on the logits (the batch over
    ``data``, nothing on ``tensor``: MaxText's rule for the residual stream and the logits'
    batch dimension), and each block under ``jax.checkpoint`` as jaxcoll's FSDP
    rematerialises its scan body: with a policy that saves every activation
    (``everything_saveable``: jaxcoll's policy saves everything but the gathered params,
    which under GSPMD are no values of the program; XLA gathers each layer in the forward
    and the backward loop alike). ``--gspmd-remat full`` saves nothing instead (MaxText's
    default ``remat_policy: full``).

Columns: ``ms`` the median step time (each step waited for; ``--rounds`` rounds, each timing
``--steps`` steps of every row in turn, A, B, C, ..., so load from other processes hits all
rows alike); ``tok/s`` = batch x context / step time; ``GFLOP`` the compiled step's
``cost_analysis()["flops"]`` (XLA:CPU reports the per-device program's; summed over the 8
devices here for the SPMD rows); ``MFU`` = GFLOP / time over the peak; ``MiB`` per-device
``argument + temp`` bytes of the compiled step (``memory_analysis()``); ``diff`` the largest
relative difference of the params from the single-device run after the same steps (from the
first row when ``single`` is not run). With ``--hlo``, a second table: each row's temp bytes
and the collectives of its compiled per-device program, counted per step (a loop body's
times its trip count; ``benchmarks/hlo_stats.py``). Then the ratios of jaxcoll's fsdp8 and
fsdp4xtp2 rows to the GSPMD rows of the same layout (time and memory).

XLA:CPU's concurrency-optimized scheduler is left on here
(``--xla_cpu_enable_concurrency_optimized_scheduler=true``, XLA's default; jaxcoll turns it
off, ``--jaxcoll-scheduler`` keeps that). With it off, the competent GSPMD steps at 8 blocks
of width 256 hung on the 2-core machine in 9 runs of 10 (the one that finished ran 2 steps
per row; XNNPACK on or off, XLA:CPU's intra-op thread pool on or off, the blocks' checkpoint
saving everything, nothing, or no checkpoint): every thread asleep, the device threads in
different collectives (in one dump 4 in an all-gather and 4 in an all-reduce, in another 9
in all-gathers): the devices' thunk executors had started independent collectives in
different orders. GSPMD's program has such independent collectives (a layer's gradient
all-reduce and the next layer's all-gathers in the backward loop); jaxcoll chains its own
by data dependencies. With the scheduler on, the same steps ran; every row here waits for
each step, and steps that overlap are what jaxcoll's setting guards against
(``jaxcoll/_xla_flags.py``). Every row runs under the same flags.

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
import hlo_stats  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll.dp.specs import merge, restrict, used_dims  # noqa: E402
from jaxcoll.dp.sync.base import mirror_specs  # noqa: E402
from jaxcoll.dp.sync.fsdp import fsdp_dim  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--width", type=int, default=None, help="model width (default: gpt's)")
parser.add_argument("--layers", type=int, default=None, help="blocks (default: gpt's)")
parser.add_argument("--steps", type=int, default=4, help="steps per row per round")
parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the rows")
LAYOUTS = ["single", "dp8", "fsdp8", "dp2xfsdp4", "fsdp4xtp2", "dp2xtp2xpp2", "fsdp2xtp2xpp2"]
parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of jaxcoll rows")
parser.add_argument(
    "--gspmd", default="naive,competent", help="comma list of GSPMD rows: naive, competent"
)
parser.add_argument(
    "--gspmd-layouts", default="fsdp8,fsdp4xtp2", help="comma list of GSPMD layouts"
)
parser.add_argument(
    "--gspmd-remat",
    choices=("save", "full", "none"),
    default="save",
    help="the competent GSPMD's jax.checkpoint per block: save every activation (jaxcoll "
    "FSDP's choice), none (MaxText's remat_policy full), or no jax.checkpoint at all",
)
parser.add_argument("--hlo", action="store_true", help="print each row's collectives")
parser.add_argument(
    "--jaxcoll-scheduler",
    action="store_true",
    help="keep jaxcoll's XLA:CPU scheduler setting (see the module's docstring)",
)
args = parser.parse_args()
if not args.jaxcoll_scheduler:  # read by jaxcoll.init (which keeps it) and by JAX, below
    os.environ["XLA_FLAGS"] += " --xla_cpu_enable_concurrency_optimized_scheduler=true"
for name, got, known in [
    ("layouts", args.layouts, LAYOUTS),
    ("gspmd", args.gspmd, ["naive", "competent"]),
    ("gspmd-layouts", args.gspmd_layouts, ["fsdp8", "fsdp4xtp2"]),
]:
    if bad := [x for x in got.split(",") if x and x not in known]:
        parser.error(f"--{name}: unknown {bad}; pick from {known}")

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

BATCH = next(gpt.batches("train", 1, seed=1))


def memory_mib(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes) / 2**20


def row_jaxcoll(name: str):
    trainer = gpt.trainer_for(name)
    state = trainer.init(gpt.init_params(), jax.random.key(0))
    step, abstract = trainer.step_program(state, BATCH)
    compiled = step.lower(*abstract).compile()
    batch = trainer.shard_batch(BATCH)

    def run(state):
        return trainer.step(state, batch)[0]

    def params(state):
        return trainer.host_params(state)

    return state, run, params, compiled, trainer.mesh.devices.size


def competent_loss(mesh: jax.sharding.Mesh):
    """``gpt.loss_fn`` as MaxText writes it: the residual stream and the logits constrained to
    the batch over ``data`` (whole over ``tensor``), each block under ``jax.checkpoint``."""
    act = NamedSharding(mesh, P("data", None, None))

    def block(p, h):
        return gpt.Block().apply({"params": p}, h)

    if args.gspmd_remat != "none":
        policy = {
            "save": jax.checkpoint_policies.everything_saveable,
            "full": jax.checkpoint_policies.nothing_saveable,
        }[args.gspmd_remat]
        block = jax.checkpoint(block, policy=policy)

    def body(h, p):
        return jax.lax.with_sharding_constraint(block(p, h), act), None

    def loss(params, batch):
        x = batch["x"]
        h = params["wte"][x] + params["wpe"][: x.shape[1]]
        h = jax.lax.with_sharding_constraint(h, act)
        h = jax.lax.scan(body, h, params["blocks"])[0]
        h = nn.LayerNorm(use_bias=gpt.BIAS).apply({"params": params["ln_f"]}, h)
        logits = jax.lax.with_sharding_constraint(h @ params["wte"].T, act)  # tied
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], axis=-1))

    return loss


def row_gspmd(shape: tuple[int, ...], names: tuple[str, ...], competent: bool):
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
    loss_fn = competent_loss(mesh) if competent else lambda p, b: gpt.loss_fn(p, b, None)[0]

    def step(params, opt_state, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
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

    return state, run, host, compiled, mesh.devices.size


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
    count = sum(x.size for x in jax.tree.leaves(nn.meta.unbox(gpt.init_params())))
    print(
        f"GPT: {gpt.LAYERS} blocks, width {gpt.WIDTH}, {gpt.HEADS} heads, context {gpt.BLOCK}, "
        f"batch {gpt.BATCH} sequences, {count / 1e6:.2f}M params; jax {jax.__version__}, "
        f"{len(jax.devices())} simulated CPU devices on {os.cpu_count()} cores"
    )
    peak = peak_flops()
    print(
        f"peak: {peak / 1e9:.1f} GFLOP/s (a 1024^3 float32 matmul on each of the 8 devices at once)"
    )
    rows = {name: row_jaxcoll(name) for name in args.layouts.split(",") if name}
    meshes = {"fsdp8": ((8,), ("data",)), "fsdp4xtp2": ((4, 2), ("data", "tensor"))}
    for how in filter(None, args.gspmd.split(",")):
        for layout in filter(None, args.gspmd_layouts.split(",")):
            rows[f"gspmd {how} {layout}"] = row_gspmd(*meshes[layout], how == "competent")
    states = {k: r[0] for k, r in rows.items()}
    for k, r in rows.items():  # compile and warm up
        print(f"warm-up: {k}", file=sys.stderr, flush=True)
        states[k] = jax.block_until_ready(r[1](states[k]))
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.rounds):
        for k, r in rows.items():
            for _ in range(args.steps):
                t = time.perf_counter()
                states[k] = jax.block_until_ready(r[1](states[k]))
                times[k].append(time.perf_counter() - t)
    steps = 1 + args.rounds * args.steps
    first = "single" if "single" in rows else next(iter(rows))
    reference = jax.tree.leaves(rows[first][2](states[first]))
    tokens = gpt.BATCH * gpt.BLOCK
    remat = {
        "save": "each block under jax.checkpoint saving every activation",
        "full": "each block under jax.checkpoint saving nothing",
        "none": "no jax.checkpoint",
    }[args.gspmd_remat]
    print(
        f"\nmedian of {args.rounds} interleaved rounds x {args.steps} steps; every row "
        f"took {steps} steps on the same batch; the competent GSPMD: {remat}\n"
    )
    print(
        "| layout | ms/step | tokens/s | GFLOP/step | MFU % | args+temp MiB/device | max rel diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    ms, mib = {}, {}
    for k, r in rows.items():
        ms[k] = 1e3 * statistics.median(times[k])
        mib[k] = memory_mib(r[3])
        got = jax.tree.leaves(r[2](states[k]))
        diff = max(
            float(np.max(np.abs(np.asarray(a) - b)) / (np.max(np.abs(b)) + 1e-12))
            for a, b in zip(got, reference, strict=True)
        )
        flop = hlo_stats.flops(r[3]) * r[4]
        mfu = 100 * flop / (ms[k] / 1e3) / peak
        print(
            f"| {k} | {ms[k]:.1f} | {tokens / (ms[k] / 1e3):,.0f} | {flop / 1e9:.3f} | "
            f"{mfu:.2f} | {mib[k]:.2f} | {diff:.1e} |"
        )
    pairs = [
        (k, f"gspmd {how} {k}")
        for how in ("competent", "naive")
        for k in ("fsdp8", "fsdp4xtp2")
        if k in rows and f"gspmd {how} {k}" in rows
    ]
    if pairs:
        print("\n| jaxcoll / GSPMD | time | memory |\n|---|---:|---:|")
        for k, g in pairs:
            print(f"| {k} / {g} | {ms[k] / ms[g]:.2f}x | {mib[k] / mib[g]:.2f}x |")
    if args.hlo:
        print(
            "\n| layout | args MiB | temp MiB | GFLOP/device | collectives per step "
            "(count x result MiB, per device) |\n|---|---:|---:|---:|---|"
        )
        for k, r in rows.items():
            m = r[3].memory_analysis()
            print(
                f"| {k} | {m.argument_size_in_bytes / 2**20:.2f} | "
                f"{m.temp_size_in_bytes / 2**20:.2f} | {hlo_stats.flops(r[3]) / 1e9:.3f} | "
                f"{hlo_stats.summary(r[3])} |"
            )


if __name__ == "__main__":
    main()
