"""Per-device memory and step time of a data-parallel training step: jaxcoll vs GSPMD vs ideal.

    .venv/bin/python benchmarks/memory.py                      # the default run, see below
    .venv/bin/python benchmarks/memory.py --layers 8,16 --steps 3 --rounds 2   # quick look

8 simulated CPU devices, Adam (``optax.adam(1e-3)``), global batch 64, float32, loss
``mean((f(x) - y) ** 2)`` with x, y of shape (64, 512). Models:

- ``scanned``: L layers ``x = tanh(x @ w + b)`` of 512x512 stacked as params
  ``{"w": (L, 512, 512), "b": (L, 512)}`` and applied with ``jax.lax.scan`` over the stack,
  for every L in ``--layers``;
- ``unrolled``: 16 separate layers ``{"l0": {"w", "b"}, ...}`` applied in a Python loop;
- ``flax-scan``: the scanned model as flax.linen ``nn.scan`` over a ``Dense`` + tanh block
  (``variable_axes={"params": 0}, split_rngs={"params": True}``), given to the Trainer as a
  plain loss that calls ``module.apply``.

Rows, for each model (and L):

- ``DDP``, ``ZeRO-1``, ``FSDP``: ``dp.Trainer(loss_fn, optax.adam(1e-3), sync=...)`` with
  ``dp.sync.DDP()``, ``dp.sync.ZeRO1()``, ``dp.sync.FSDP()`` on one mesh axis of 8 devices;
- ``HSDP``: ``dp.sync.FSDP()`` on ``jax.make_mesh((2, 4), ("replica", "shard"))`` (Auto axes)
  with ``layout=dp.Layout(replicate="replica", shard="shard")``;
- ``GSPMD FSDP``: what a user writes in plain JAX: ``jax.jit`` of value_and_grad + optax
  update, params and Adam state placed by ``NamedSharding`` over the 8 devices, each leaf
  split along one dimension (the stacked leaves along dim 1, not the layer axis, so that XLA
  can gather one layer per loop iteration; the unrolled leaves along dim 0), the batch split
  over the devices, ``out_shardings`` equal to the input shardings, params and optimizer
  state donated (``GSPMD FSDP (naive)``: no constraint on any activation);
- ``GSPMD FSDP (competent)`` (``--rows gspmd-competent``): the same, written as MaxText writes
  it: ``jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("fsdp", None)))`` on the
  input and on every layer's output (the batch over the devices), and every layer under
  ``jax.checkpoint`` with the policy that saves every activation, as jaxcoll's FSDP
  rematerialises its layers (its policy saves everything but the gathered params, which
  under GSPMD are no values of the program);
- ``ideal FSDP`` (computed, not run): per device, with P the bytes of one copy of the params,
  p the bytes of one layer (w + b), L layers and B the global batch::

      ideal = 3 P / 8          # params, Adam mu and nu, each split over the 8 devices
            + 2 p              # two gathered layers (the one in use and the next one)
            + p                # one layer of full (not yet reduce-scattered) gradient
            + L (B / 8) 512 4  # saved activations: one (B/8, 512) float32 per layer,
                               # the residual the backward needs

  (the device's slice of the batch, 32 KiB, and the scalars are left out).

Memory is per device, from the compiled step's ``memory_analysis()`` (for jaxcoll
``trainer.step_program(state, batch)``, lowered and compiled; for GSPMD its jitted step):
``args`` is ``argument_size_in_bytes`` (the state's and the batch's buffers on one device),
``temp`` is ``temp_size_in_bytes`` (XLA's scratch for the step), ``args+temp`` their sum and
``/ideal`` its ratio to the ideal row; ``out-alias`` is the output bytes that do not reuse a
donated input (``output_size_in_bytes - alias_size_in_bytes``: the metrics, and everything
a step returns that it could not write in place). The bounds checked: scanned (and
flax-scan) FSDP ``args+temp <= 1.5 x ideal`` at every L; unrolled FSDP ``args+temp <=``
ZeRO-1's, ``<= 1.2 x`` each GSPMD's and (when the run has the scanned model at L = 16)
``<= 1.2 x`` the scanned FSDP's. Below each table: jaxcoll FSDP's time and args+temp over each GSPMD
row's; with ``--hlo``, each row's FLOPs and the collectives of its compiled per-device
program per step (``benchmarks/hlo_stats.py``).

Time: the median of per-step wall times (each step waited for with
``jax.block_until_ready``) after ``--warmup`` steps. Within one model (and L) every row is
compiled and warmed up first, then each of ``--rounds`` rounds times a share of every row's
steps in turn (A, B, C, A, B, C, ...), so that load from other processes on a shared machine
hits all rows alike. Large L is slow on 2 CPU cores, so a model with more than 16 layers
times ``max(3, steps * 16 // L)`` steps per row instead of ``--steps`` (the header says how
many each table used).

The tables of the current code are in ``docs/benchmarks.md`` ("FSDP peak memory and step
time"). Before FSDP gathered per layer (commit 69f8f7a), the same default run gave, for the
scanned model, jaxcoll FSDP args+temp 20.49, 39.90, 78.73 and 156.38 MiB at L = 8, 16, 32, 64
(3.34x, 4.31x, 5.07x, 5.57x the ideal; its temp about twice the params: every param gathered
at the loss's start plus the stacked gradient), against GSPMD's 6.45, 10.83, 19.60 and 37.13
MiB; unrolled, 16 layers: FSDP 22.09, ZeRO-1 22.54, GSPMD 21.23 MiB. Before the unrolled
model's re-gathers were tied to the backward (XLA:CPU drops ``jax.checkpoint``'s optimization
barriers, then merges each re-gather with the forward's gather: every gathered layer stayed
alive into the backward) and a bucket could span several layers, the unrolled FSDP row was
38.13 MiB (21.64 per leaf) against the scanned FSDP's 10.83.

A nanoGPT-shaped GPT written as a Python loop over its blocks: ``benchmarks/memory_gpt.py``.

What GSPMD does (read in its compiled HLO): on the scanned model the forward and backward
loops each gather one (512, 512) layer per iteration, and the backward all-reduces each
layer's whole weight gradient and keeps its slice (no reduce-scatter); on the unrolled model
it issues all 16 layer gathers at the top of the program, so its temp is about one copy of
the params.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import date

import jaxcoll

DEVICES = 8
MODELS = ("scanned", "unrolled", "flax-scan")
ROWS = (
    "ddp",
    "zero1",
    "zero1-per-leaf",
    "fsdp",
    "fsdp-per-leaf",
    "hsdp",
    "gspmd",
    "gspmd-competent",
)
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--layers", default="8,16,32,64", help="comma list of L (scanned models)")
parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
parser.add_argument("--steps", type=int, default=10, help="timed steps per row (L <= 16)")
parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row after compile")
parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the rows")
parser.add_argument("--hlo", action="store_true", help="print each row's collectives")
args = parser.parse_args()
for name, got, known in [("models", args.models, MODELS), ("rows", args.rows, ROWS)]:
    bad = [x for x in got.split(",") if x not in known]
    if bad:
        parser.error(f"--{name}: unknown {bad}; pick from {known}")
# jaxcoll's XLA:CPU flags (the device count, and collectives on a loaded machine finish
# instead of aborting); set before JAX starts its backend.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *jaxcoll.xla_cpu_flags(devices=DEVICES)]
).strip()

import hlo_stats  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import plain_step  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import dp  # noqa: E402

WIDTH = 512
BATCH = 64
UNROLLED = 16  # layers of the unrolled model
LR = 1e-3
MIB = 2**20
FLOAT = 4  # bytes


# ------------------------------------------------------------------------------------ models
#: The competent GSPMD row's activation sharding (the batch over the devices), set while its
#: step is traced; None for every other row.
ACT: list = [None]


def act(x):
    """``x`` constrained to the batch over the devices in the competent GSPMD row."""
    return x if ACT[0] is None else jax.lax.with_sharding_constraint(x, ACT[0])


def remat(f):
    """``f`` under ``jax.checkpoint`` in the competent GSPMD row, saving every activation
    (jaxcoll's FSDP saves everything but the gathered params, which GSPMD has no values
    for); ``f`` itself in the other rows."""
    if ACT[0] is None:
        return f
    return jax.checkpoint(f, policy=jax.checkpoint_policies.everything_saveable)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def scanned_params(layers: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": (rng.normal(size=(layers, WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
        "b": np.zeros((layers, WIDTH), np.float32),
    }


def scanned_loss(params, batch, rng=None):
    @remat
    def layer(x, wb):
        w, b = wb
        return act(jnp.tanh(x @ w + b)), None

    out, _ = jax.lax.scan(layer, act(batch["x"]), (params["w"], params["b"]))
    return mse(out, batch["y"]), {}


def unrolled_params(layers: int) -> dict:
    stacked = scanned_params(layers)
    return {f"l{i}": {"w": stacked["w"][i], "b": stacked["b"][i]} for i in range(layers)}


def unrolled_loss(params, batch, rng=None):
    x = act(batch["x"])
    for i in range(len(params)):
        x = act(remat(lambda x, p: jnp.tanh(x @ p["w"] + p["b"]))(x, params[f"l{i}"]))
    return mse(x, batch["y"]), {}


def flax_model(layers: int):
    """(params, loss_fn) of the flax.linen ``nn.scan`` model with ``layers`` layers."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return act(jnp.tanh(nn.Dense(WIDTH)(x))), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = Block
            if ACT[0] is not None:
                block = nn.remat(Block, policy=jax.checkpoint_policies.everything_saveable)
            scan = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=layers,
            )
            return scan(name="layers")(act(x), None)[0]  # one name, remat or not

    module = Stack()
    params = module.init(jax.random.key(0), jnp.zeros((1, WIDTH)))["params"]

    def loss_fn(params, batch, rng=None):
        return mse(module.apply({"params": params}, batch["x"]), batch["y"]), {}

    return jax.device_get(params), loss_fn


def model(name: str, layers: int):
    """(params, loss_fn, stacked): ``stacked`` when the leaves carry a leading layer axis."""
    if name == "scanned":
        return scanned_params(layers), scanned_loss, True
    if name == "unrolled":
        return unrolled_params(layers), unrolled_loss, False
    return (*flax_model(layers), True)


def ideal_bytes(params, layers: int) -> int:
    """The ideal FSDP row (the module docstring's formula), in bytes per device."""
    total = sum(x.size * FLOAT for x in jax.tree.leaves(params))
    layer = total // layers
    saved = layers * (BATCH // DEVICES) * WIDTH * FLOAT
    return 3 * total // DEVICES + 2 * layer + layer + saved


# ------------------------------------------------------------------------------------ timing
def timed(step, state, batch):
    """``run``: ``run(k)`` times k steps, each waited for, after a first call and warm-up."""
    state = jax.block_until_ready(step(state, batch))
    for _ in range(args.warmup):
        state = jax.block_until_ready(step(state, batch))
    held = [state]

    def run(k: int) -> list[float]:
        times = []
        for _ in range(k):
            t = time.perf_counter()
            held[0] = jax.block_until_ready(step(held[0], batch))
            times.append(time.perf_counter() - t)
        return times

    return run


def interleaved(runs: list, steps: int) -> list[float]:
    """Median step ms of every row, its ``steps`` steps timed in interleaved rounds."""
    rounds = max(1, min(args.rounds, steps))
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        k = steps // rounds + (r < steps % rounds)
        for i, run in enumerate(runs):
            times[i].extend(run(k))
    return [1e3 * statistics.median(t) for t in times]


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return {
        "args": m.argument_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "out-alias": m.output_size_in_bytes - m.alias_size_in_bytes,
        "hlo": f"{hlo_stats.flops(compiled) / 1e9:.3f} GFLOP/device; "
        + hlo_stats.summary(compiled),
    }


# -------------------------------------------------------------------------------------- rows
def row_trainer(params, loss_fn, batch, sync, mesh=None, layout=None):
    trainer = dp.Trainer(loss_fn, optax.adam(LR), sync=sync, mesh=mesh, layout=layout)
    state = trainer.init(params, jax.random.key(0))
    step, specs = trainer.step_program(state, batch)
    mem = memory(step.lower(*specs).compile())
    placed = trainer.shard_batch(batch)
    return mem, timed(lambda s, b: trainer.step(s, b)[0], state, placed)


def row_hsdp(params, loss_fn, batch):
    # Auto axes: jax.make_mesh's default (Explicit) axes refuse the Trainer's
    # with_sharding_constraint placement of split state.
    mesh = jax.make_mesh((2, 4), ("replica", "shard"), axis_types=(AxisType.Auto,) * 2)
    layout = dp.Layout(replicate="replica", shard="shard")  # FSDP over "shard": HSDP
    return row_trainer(params, loss_fn, batch, dp.sync.FSDP(), mesh, layout)


def row_gspmd(params, loss_fn, batch, stacked: bool, competent: bool = False):
    """Plain-JAX FSDP: jit + NamedSharding, every split leaf split along one dimension;
    ``competent``: each layer's output constrained to the batch over the devices and each
    layer under ``jax.checkpoint`` (saving every activation), as MaxText writes it."""
    opt = optax.adam(LR)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    ACT[0] = NamedSharding(mesh, P("fsdp", None)) if competent else None
    try:
        return _row_gspmd(params, loss_fn, batch, stacked, opt, mesh)
    finally:
        ACT[0] = None


def _row_gspmd(params, loss_fn, batch, stacked, opt, mesh):

    def spec(x) -> P:
        # The stacked (L, 512, 512) and (L, 512) along dim 1, the layer axis whole; the
        # unrolled (512, 512) and (512,) along dim 0; scalars (Adam's count) replicated.
        dim = 1 if stacked else 0
        if np.ndim(x) <= dim:
            return P()
        return P(*[None] * dim, "fsdp")

    def shardings(tree):
        return jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), tree)

    p_sh = shardings(params)
    o_sh = shardings(jax.eval_shape(opt.init, params))
    b_sh = NamedSharding(mesh, P("fsdp"))
    rep = NamedSharding(mesh, P())

    step = plain_step.jit_step(loss_fn, opt, p_sh, o_sh, b_sh, rep)
    placed_params = jax.device_put(params, p_sh)
    opt_state = jax.jit(opt.init, out_shardings=o_sh)(placed_params)
    placed = jax.device_put(batch, b_sh)
    mem = memory(step.lower(placed_params, opt_state, placed).compile())

    def run(state, b):
        return step(*state, b)[:2]

    return mem, timed(run, (placed_params, opt_state), placed)


# ------------------------------------------------------------------------------------ tables
NAIVE, COMPETENT = "GSPMD FSDP (naive)", "GSPMD FSDP (competent)"
#: FSDP's args+temp per (model, L), for the unrolled model's bound against the scanned one's.
FSDP_PEAKS: dict[tuple[str, int], int] = {}


def table(name: str, layers: int, rows: list[str]) -> list[str]:
    params, loss_fn, stacked = model(name, layers)
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
    }
    ideal = ideal_bytes(params, layers)
    built: list[tuple[str, object]] = []  # (label, (mem, run))
    for row in rows:
        if row == "ddp":
            built.append(("jaxcoll DDP", row_trainer(params, loss_fn, batch, dp.sync.DDP())))
        elif row == "zero1":
            built.append(("jaxcoll ZeRO-1", row_trainer(params, loss_fn, batch, dp.sync.ZeRO1())))
        elif row == "fsdp":
            built.append(("jaxcoll FSDP", row_trainer(params, loss_fn, batch, dp.sync.FSDP())))
        elif row == "fsdp-per-leaf":
            sync = dp.sync.FSDP(bucket_mb=None)
            built.append(("jaxcoll FSDP per leaf", row_trainer(params, loss_fn, batch, sync)))
        elif row == "zero1-per-leaf":
            sync = dp.sync.ZeRO1(bucket_mb=None)
            built.append(("jaxcoll ZeRO-1 per leaf", row_trainer(params, loss_fn, batch, sync)))
        elif row == "hsdp":
            built.append(("jaxcoll HSDP (2 x 4)", row_hsdp(params, loss_fn, batch)))
        elif row == "gspmd":
            built.append((NAIVE, row_gspmd(params, loss_fn, batch, stacked)))
        elif row == "gspmd-competent":
            built.append((COMPETENT, row_gspmd(params, loss_fn, batch, stacked, True)))
    steps = args.steps if layers <= 16 else max(3, args.steps * 16 // layers)
    live = [b for _, b in built if b is not None]
    medians = iter(interleaved([b[1] for b in live], steps))
    total = sum(x.size * FLOAT for x in jax.tree.leaves(params))
    title = f"{name}, L={layers}" if name != "unrolled" else f"unrolled, {layers} layers"
    out = [
        f"\n{title}: params {total / MIB:.1f} MiB, ideal {ideal / MIB:.2f} MiB per device; "
        f"median of {steps} steps",
        "",
        "| row                     | args MiB | temp MiB | args+temp | /ideal | out-alias "
        "| step ms |",
        "|-------------------------|---------:|---------:|----------:|-------:|----------:"
        "|--------:|",
    ]
    sums: dict[str, int] = {}
    ms: dict[str, float] = {}
    for label, b in built:
        mem, _ = b
        both = mem["args"] + mem["temp"]
        sums[label] = both
        ms[label] = next(medians)
        out.append(
            f"| {label:23s} | {mem['args'] / MIB:8.2f} | {mem['temp'] / MIB:8.2f} "
            f"| {both / MIB:9.2f} | {both / ideal:5.2f}x | {mem['out-alias'] / MIB:9.2f} "
            f"| {ms[label]:7.1f} |"
        )
    out.append(
        f"| {'ideal FSDP (computed)':23s} | {'':8s} | {'':8s} | {ideal / MIB:9.2f} "
        f"| {1:5.2f}x | {'':9s} | {'-':>7s} |"
    )
    for gspmd in (COMPETENT, NAIVE):
        for row in ("jaxcoll FSDP", "jaxcoll FSDP per leaf"):
            if row in sums and gspmd in sums:
                out.append(
                    f"{row} / {gspmd}: time {ms[row] / ms[gspmd]:.2f}x, "
                    f"memory {sums[row] / sums[gspmd]:.2f}x"
                )
    if args.hlo:
        out.append("")
        out.extend(f"{label}: {b[0]['hlo']}" for label, b in built if b is not None)
    fsdp = sums.get("jaxcoll FSDP")
    if fsdp is not None:
        FSDP_PEAKS[name, layers] = fsdp
    if fsdp is not None and stacked:
        ok = fsdp <= 1.5 * ideal
        out.append(
            f"\nbound: FSDP args+temp {fsdp / ideal:.2f}x ideal <= 1.5x: "
            f"{'holds' if ok else 'FAILS'}"
        )
    elif fsdp is not None:
        others = [
            ("ZeRO-1's", 1.0, sums.get("jaxcoll ZeRO-1")),
            ("the naive GSPMD's", 1.2, sums.get(NAIVE)),
            ("the competent GSPMD's", 1.2, sums.get(COMPETENT)),
            (f"the scanned L={layers} FSDP's", 1.2, FSDP_PEAKS.get(("scanned", layers))),
        ]
        out.append("")
        for what, factor, other in others:
            if other is not None:
                ok = fsdp <= factor * other
                out.append(
                    f"bound: FSDP args+temp {fsdp / MIB:.2f} MiB <= {factor:g} x {what} "
                    f"{other / MIB:.2f} MiB: {'holds' if ok else 'FAILS'}"
                )
    return out


def main() -> int:
    layers = [int(x) for x in args.layers.split(",")]
    rows = args.rows.split(",")
    models = args.models.split(",")
    print(
        f"Per-device memory and step time: {jax.device_count()} simulated CPU devices on "
        f"{os.cpu_count()} CPU cores (shared)\njax {jax.__version__}, optax "
        f"{optax.__version__}; Adam, global batch {BATCH}, float32, width {WIDTH}\n"
        f"{args.warmup} warm-up steps, {args.rounds} interleaved rounds; {date.today()}"
    )
    for name in models:
        for n in layers if name != "unrolled" else [UNROLLED]:
            print("\n".join(table(name, n, rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
