"""A mixture-of-experts model trained by jaxcoll (expert parallel inside a ``dp.Trainer``)
against the same model in plain JAX, GSPMD as GShard / MaxText write it: step time,
per-device memory, collectives.

    .venv/bin/python benchmarks/experts.py                  # 5 interleaved rounds (~2 min)
    .venv/bin/python benchmarks/experts.py --rounds 3 --rows jaxcoll-fsdp8,gspmd

8 simulated CPU devices. The model: a token embedding (vocabulary 256, width 128), 2 blocks
``h = h + MoE(LayerNorm(h))``, a dense head; each MoE is ``jaxcoll.nn.MoE(num_experts=8,
hidden=256, k=2)``: a softmax router over 8 experts, each token's top 2, their outputs summed
with the two chosen probabilities as gates (not renormalised), each expert
``gelu(x @ w_in[e]) @ w_out[e]`` with ``jaxcoll.parallel.gelu`` (exact). The loss: the
next-token cross-entropy + 0.01 x the load-balancing losses of both layers
(``jaxcoll.parallel.moe_metrics``: ``E * sum_e f_e P_e`` over the whole batch, Switch Transformer).
AdamW (``optax.adamw(1e-3)``), one fixed global batch of 16 sequences of 128 tokens; both
rows start from the same params.

Rows:

- ``jaxcoll fsdp8+ep8``: ``dp.Trainer(loss, optax.adamw(1e-3), layout=dp.Layout(shard=8,
  expert=8))``: FSDP over the 8 devices for the dense params, one expert per device (the
  expert axis borrows the data shards). jaxcoll's MoE is **dropless**: each device sorts its
  256 x 2 assignments by destination, one ragged all-to-all delivers them into a buffer with
  room for every assignment of every device (8 x 512 rows), the device's expert runs on its
  rows by ``jax.lax.ragged_dot``, one ragged all-to-all brings the outputs back (two more in
  the backward); the load over the whole batch is summed over the devices.
- ``jaxcoll fsdp8+ep8 capacity 2.0``: the same layout, ``MoE(..., capacity_factor=2.0)``:
  each expert keeps 64 assignments per sequence, in GShard's order (so the same as the GShard
  row below drops), each device sends at most ``2 sequences x 64`` rows to each expert's
  device, and its receive buffer holds ``8 x 128`` rows.
- ``jaxcoll fsdp8+ep8 buffer 2.0`` (``--rows jaxcoll-fsdp8-bounded``): the same layout,
  dropless at bounded memory, ``MoE(..., buffer_factor=2.0)``: each device's receive buffer
  holds twice the balanced load (``8 x ceil(2.0 x 512 / 8) = 8 x 128`` rows, the capacity
  row's), each device sends at most 128 rows to each expert's device per round, and what
  does not fit goes in further rounds (at most ``512 / 128 = 4``; the rounds needed, agreed
  by one ``pmax`` of the counts, run, the others are skipped by a ``lax.cond``; a round's
  buffers are recomputed in the backward, not kept). Nothing is dropped whatever the
  routing (all tokens to one expert: 4 rounds).
- ``jaxcoll ddp8+ep8``: the same with ``dp.Layout(replicate=8, expert=8)``: the dense params
  replicated (DDP), the experts still one per device.
- ``gspmd gshard``: the same model and math in plain JAX under ``jax.jit``
  (``benchmarks/plain_step.py``: value_and_grad + the optax update, params and optimizer
  state placed by ``NamedSharding`` and donated) on a mesh of one axis ``data`` (8): the
  expert weights ``w_in`` / ``w_out`` split along the expert dimension, every other param
  split FSDP-style along the dimension jaxcoll's FSDP picks (``fsdp_dim``), the batch split
  over ``data``. The MoE is GShard's einsum formulation: groups = sequences (16 groups of 128
  tokens), each expert's capacity per group ``C = ceil(2.0 x 128 x 2 / 8) = 64`` (capacity
  factor **2.0**: twice the even share; assignments past it are dropped, first choices
  before second ones), a one-hot dispatch tensor ``(G, S, E, C)`` and a combine tensor (the
  gates) built from the same top-2 softmax router, ``einsum("gsec,gsd->egcd")`` into the
  expert-major tensor ``(E, G, C, d)`` constrained to ``P("data")`` (split along E: XLA's
  partitioner turns the reshard into an all-to-all), the experts' two einsums on it, the
  output constrained along E again, ``einsum("gsec,egcd->gsd")`` back, constrained to the
  tokens over ``data`` (``jax.lax.with_sharding_constraint``, as are the embedding's output
  and each block's). Every expert computes its whole ``G x C`` buffer, padding included
  (capacity factor 2: twice the useful expert FLOPs), plus the dispatch and combine
  einsums.
- ``gspmd ragged_dot``: the same jit, shardings and constraints, the MoE dropless the way a
  plain-JAX user writes it without shard_map: every assignment of the batch (token-major,
  then slot) sorted by expert (a stable argsort), the experts' matmuls by
  ``jax.lax.ragged_dot`` with the group sizes, the sorted rows and the experts' output
  constrained to ``P("data")``, the outputs unsorted by a scatter and summed with the gates.
  XLA's partitioner has no expert-parallel rule for ``ragged_dot``: it gathers the sorted
  rows (and the experts' hidden activations) instead of exchanging them.

The ``step-0 loss`` column is the loss of the first step (the initial params): with no
assignment dropped by GSPMD's capacity (``gspmd dropped`` below the table, counted in both
layers at step 0) the rows compute the same function and the losses agree to float32
rounding (the check asks ``|a - b| <= 1e-5 |b|``); a drop would make them differ by the
dropped experts' outputs.

Columns: ``ms`` the median step time (each step waited for with ``block_until_ready``; after
a compile and a warm-up step per row, ``--rounds`` rounds each timing ``--steps`` steps of
every row in turn, A, B, C, A, B, C, ...); ``args`` / ``temp`` the compiled step's
``memory_analysis()`` per device (``argument_size_in_bytes``: state and batch;
``temp_size_in_bytes``: XLA's scratch), ``peak`` their sum; ``GFLOP`` the per-device
program's ``cost_analysis()`` flops; the collectives of the compiled per-device program per
step, count x result MiB (``benchmarks/hlo_stats.py``). Then jaxcoll / GSPMD ratios.

What the default run gave (jax 0.10.2, 2 cores; ms, peak MiB per device): jaxcoll
fsdp8+ep8 284 / 69.7, with capacity 2.0 60 / 21.6, ddp8+ep8 248 / 60.9; GSPMD GShard 77 /
17.5, GSPMD ragged_dot 219 / 34.4; every step-0 loss 5.59523 (GShard dropped nothing). With
GShard's capacity jaxcoll takes 0.79x its time and 1.24x its memory. Dropless, it takes 3.7x
and 4.0x: its buffer is sized for the worst case, every assignment of every device on one
expert (8 x 512 = 4096 rows per device per layer, 8 times the mean load and 4 times GShard's
``G/8 x C = 128`` rows per device at capacity factor 2); on XLA:CPU its all-to-alls carry
that whole buffer and ``jax.lax.ragged_dot`` costs the same for 512 valid rows of 4096 as for
4096 (1.6 vs 1.2 ms for a (4096, 128) x (128, 256) one), so the experts compute every padding
row (4.0 GFLOP per device per step against GShard's 1.25). On GPUs the ragged all-to-all
moves only the routed rows; the buffer's memory stays. The GSPMD ragged_dot row moves no
tokens by all-to-all: it all-gathers the sorted rows (59 all-gathers, 40 MiB a step).

Bounded dropless (``--rows jaxcoll-fsdp8-capacity,jaxcoll-fsdp8-bounded,gspmd-ragged
--rounds 3``, one interleaved run, jax 0.10.2, the 2 cores shared with other work (a load
near 9), so every time is several times the default run's above; ms, args + temp = peak MiB
per device): capacity 2.0 394 / 1.60 + 20.11 = 21.71, buffer 2.0 530 / 1.60 + 12.66 = 14.26,
GSPMD ragged_dot 1834 / 1.60 + 32.77 = 34.37; every step-0 loss 5.595233. So the bounded
dropless row takes 0.66x the capacity row's memory and 0.29x the GSPMD dropless row's time
(1.34x the capacity row's; an earlier run under more load: 0.32x and 1.23x). At balanced
routing one round
runs; its buffers are the capacity row's, and recomputing the round's forward in the
backward costs the extra time. Its memory is below the capacity row's because that row's
backward keeps its activations (the buffer's rows through both matmuls) and this one does
not. The collectives column counts every round of the scan as if it ran (4 per layer, 40
all-to-alls; at balanced routing one round per layer runs) and ``GFLOP`` counts the scan's
body once. On XLA:CPU, ``jax.lax.ragged_dot`` is a masked dense matmul (its cost is
``E_local x`` the buffer's rows whatever the group sizes): the experts compute the buffer's
padding rows too (about half of them at factor 2.0 and balanced routing); where XLA has a
ragged-dot instruction (GPU, TPU) it is lowered to it.

XLA:CPU flags: jaxcoll's (``jaxcoll.xla_cpu_flags``: collective timeouts) except its
scheduler setting: the concurrency-optimized scheduler stays on, XLA's default, as in
``benchmarks/nd.py`` (GSPMD programs hung with it off there); ``--jaxcoll-scheduler`` turns it
off for every row. Every row runs under the same flags.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jaxcoll

ROWS = (
    "jaxcoll-fsdp8",
    "jaxcoll-fsdp8-capacity",
    "jaxcoll-fsdp8-bounded",
    "jaxcoll-ddp8",
    "gspmd",
    "gspmd-ragged",
)
parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the rows")
parser.add_argument("--steps", type=int, default=3, help="steps per row per round")
parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
parser.add_argument(
    "--capacity-factor", type=float, default=2.0, help="GSPMD's and the capacity row's"
)
parser.add_argument(
    "--buffer-factor", type=float, default=2.0, help="the bounded dropless row's buffer_factor"
)
parser.add_argument(
    "--jaxcoll-scheduler",
    action="store_true",
    help="keep jaxcoll's XLA:CPU scheduler setting (see the module's docstring)",
)
args = parser.parse_args()
if bad := [x for x in args.rows.split(",") if x not in ROWS]:
    parser.error(f"--rows: unknown {bad}; pick from {ROWS}")
flags = jaxcoll.xla_cpu_flags(devices=8)
if not args.jaxcoll_scheduler:
    flags = [f for f in flags if "concurrency_optimized_scheduler" not in f]
    flags.append("--xla_cpu_enable_concurrency_optimized_scheduler=true")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import hlo_stats  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import plain_step  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import dp, parallel  # noqa: E402
from jaxcoll import nn as pnn  # noqa: E402
from jaxcoll.dp.sync.base import mirror_specs  # noqa: E402
from jaxcoll.dp.sync.fsdp import fsdp_dim  # noqa: E402
from jaxcoll.parallel.moe.router import capacity_of  # noqa: E402

VOCAB, WIDTH, HIDDEN, SEQ, BATCH = 256, 128, 256, 128, 16
EXPERTS, K, LAYERS, AUX = 8, 2, 2, 0.01
MIB = 2**20


# ------------------------------------------------------------------------------------ model
class Model(nn.Module):
    """Embedding -> LAYERS x (h + MoE(LayerNorm(h))) -> head."""

    capacity_factor: float | None = None  # None: dropless
    buffer_factor: float | None = None  # dropless: None, room for the worst case

    @nn.compact
    def __call__(self, x):
        h = nn.Embed(VOCAB, WIDTH, name="embed")(x)
        for i in range(LAYERS):
            cf, bf = self.capacity_factor, self.buffer_factor
            moe = pnn.MoE(
                EXPERTS, HIDDEN, k=K, capacity_factor=cf, buffer_factor=bf, name=f"moe{i}"
            )
            h = h + moe(nn.LayerNorm(name=f"ln{i}")(h))
        return nn.Dense(VOCAB, name="head")(h)


MODEL = Model()


def cross_entropy(logits, y):
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))


def jaxcoll_loss(model=MODEL):
    def loss(params, batch, rng=None):
        logits, sown = model.apply({"params": params}, batch["x"], mutable=["intermediates"])
        ce = cross_entropy(logits, batch["y"])
        metrics = parallel.moe_metrics(sown["intermediates"])
        return ce + AUX * metrics["moe_aux"], {"lm_loss": ce, **metrics}

    return loss


def top2(p, x):
    """The router: ``(probs (G, S, E), gate (G, S, K), expert (G, S, K), one-hot (G, S, K, E),
    the load-balancing loss over the whole batch)``."""
    logits = jnp.einsum("gsd,de->gse", x.astype(jnp.float32), p["router"].astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    gate, idx = jax.lax.top_k(probs, K)
    mask = jax.nn.one_hot(idx, EXPERTS, dtype=jnp.float32)
    tokens = x.shape[0] * x.shape[1]
    fraction = jnp.sum(mask, axis=(0, 1, 2)) / (tokens * K)
    aux = EXPERTS * jnp.sum(fraction * jnp.sum(probs, axis=(0, 1)) / tokens)
    return probs, gate, idx, mask, aux


def gshard_moe(p, x, capacity, constrain):
    """GShard's MoE on ``x`` ``(G, S, d)`` (groups = sequences): ``(y, aux, kept)``."""
    g, s, _ = x.shape
    _, gate, _, mask, aux = top2(p, x)  # mask (G, S, K, E)
    # position in the expert's buffer: every first choice of the group, then the second ones
    slots = jnp.swapaxes(mask, 1, 2).reshape(g, K * s, EXPERTS)
    ahead = jnp.cumsum(slots, axis=1) - slots
    pos = jnp.swapaxes(jnp.sum(ahead * slots, -1).reshape(g, K, s), 1, 2)  # (G, S, K)
    keep = pos < capacity
    where = mask * keep[..., None]  # (G, S, K, E)
    slot = jax.nn.one_hot(pos.astype(jnp.int32), capacity, dtype=jnp.float32)  # (G,S,K,C)
    dispatch = jnp.einsum("gske,gskc->gsec", where, slot)
    combine = jnp.einsum("gske,gskc,gsk->gsec", where, slot, gate)
    xe = constrain(jnp.einsum("gsec,gsd->egcd", dispatch, x), P("data"))  # split along E
    hid = parallel.gelu(jnp.einsum("egcd,edh->egch", xe, p["w_in"]))
    ye = constrain(jnp.einsum("egch,ehd->egcd", hid, p["w_out"]), P("data"))
    y = constrain(jnp.einsum("gsec,egcd->gsd", combine, ye), P("data"))
    return y.astype(x.dtype), aux, jnp.sum(keep)


def ragged_moe(p, x, capacity, constrain):
    """Dropless, the plain-JAX way: every assignment of the batch sorted by expert, the
    experts' grouped matmuls by ``jax.lax.ragged_dot``: ``(y, aux, kept)``."""
    g, s, d = x.shape
    _, gate, idx, _, aux = top2(p, x)
    rows = jnp.repeat(x.reshape(g * s, d), K, axis=0)  # token-major, then slot
    expert = idx.reshape(-1)
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.zeros((EXPERTS,), jnp.int32).at[expert].add(1)
    xs = constrain(rows[order], P("data"))
    hid = parallel.gelu(jax.lax.ragged_dot(xs, p["w_in"], sizes))
    out = constrain(jax.lax.ragged_dot(hid, p["w_out"], sizes), P("data"))
    back = jnp.zeros_like(out).at[order].set(out)
    y = jnp.sum((back * gate.reshape(-1, 1)).reshape(g * s, K, d), axis=1)
    return constrain(y.reshape(g, s, d), P("data")), aux, g * s * K


def gspmd_loss(mesh, capacity, moe):
    def constrain(v, spec):
        return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))

    def loss(params, batch):
        h = constrain(params["embed"]["embedding"][batch["x"]], P("data"))
        aux, kept = 0.0, 0
        for i in range(LAYERS):
            u = nn.LayerNorm().apply({"params": params[f"ln{i}"]}, h)
            y, a, n = moe(params[f"moe{i}"], u, capacity, constrain)
            h = constrain(h + y, P("data"))
            aux, kept = aux + a, kept + n
        logits = nn.Dense(VOCAB).apply({"params": params["head"]}, h)
        ce = cross_entropy(logits, batch["y"])
        dropped = 1.0 - kept / (LAYERS * h.shape[0] * h.shape[1] * K)
        return ce + AUX * aux, {"lm_loss": ce, "moe_aux": aux, "moe_dropped": dropped}

    return loss


def init_params():
    """The params, boxed (the experts' leaves name the expert axis)."""
    return MODEL.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]


def make_batch():
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1))
    return {"x": x[:, :-1].astype(np.int32), "y": x[:, 1:].astype(np.int32)}


BATCH_NP = make_batch()


# ------------------------------------------------------------------------------------- rows
class Row:
    """A row: its compiled step, its state and a ``run(state) -> (state, loss)``."""

    def __init__(self, compiled, state, run):
        self.compiled, self.state, self.run = compiled, state, run
        self.first_loss: float | None = None
        self.times: list[float] = []


def row_jaxcoll(
    layout: dp.Layout, capacity_factor: float | None = None, buffer_factor: float | None = None
) -> Row:
    loss = jaxcoll_loss(Model(capacity_factor, buffer_factor))
    trainer = dp.Trainer(loss, optax.adamw(1e-3), layout=layout)
    state = trainer.init(init_params(), jax.random.key(0))
    step, abstract = trainer.step_program(state, BATCH_NP)
    compiled = step.lower(*abstract).compile()
    batch = trainer.shard_batch(BATCH_NP)

    def run(state):
        state, metrics = trainer.step(state, batch)
        return state, metrics["loss"]

    return Row(compiled, state, run)


def row_gspmd(moe) -> tuple[Row, float]:
    """A GSPMD row with the MoE ``moe``, and the share of assignments dropped at step 0."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    n = mesh.shape["data"]
    params = nn.unbox(init_params())

    def spec(path, x):
        if any(getattr(k, "key", None) in ("w_in", "w_out") for k in path):
            return P("data")  # the experts, split along E
        dim = fsdp_dim(x.shape, n)
        return P() if dim is None else P(*([None] * dim), "data")

    specs = jax.tree_util.tree_map_with_path(spec, params)
    p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
    opt = optax.adamw(1e-3)
    o_sh = jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        mirror_specs(jax.eval_shape(opt.init, params), params, specs),
        is_leaf=lambda s: isinstance(s, P),
    )
    capacity = capacity_of(SEQ, K, EXPERTS, args.capacity_factor)
    loss = gspmd_loss(mesh, capacity, moe)
    replicated = NamedSharding(mesh, P())
    b_sh = NamedSharding(mesh, P("data"))
    step = plain_step.jit_step(loss, opt, p_sh, o_sh, b_sh, replicated)
    placed = jax.device_put(params, p_sh)
    state = (placed, jax.jit(opt.init, out_shardings=o_sh)(placed))
    batch = jax.device_put(BATCH_NP, b_sh)
    compiled = step.lower(*state, batch).compile()
    dropped = float(jax.jit(lambda p, b: loss(p, b)[1]["moe_dropped"])(placed, batch))

    def run(state):
        params, opt_state, value = step(*state, batch)
        return (params, opt_state), value

    return Row(compiled, state, run), dropped


def main() -> None:
    names = args.rows.split(",")
    rows: dict[str, Row] = {}
    dropped = None
    if "jaxcoll-fsdp8" in names:
        rows["jaxcoll fsdp8+ep8"] = row_jaxcoll(dp.Layout(shard=8, expert=8))
    if "jaxcoll-fsdp8-capacity" in names:
        name = f"jaxcoll fsdp8+ep8 capacity {args.capacity_factor}"
        rows[name] = row_jaxcoll(dp.Layout(shard=8, expert=8), args.capacity_factor)
    if "jaxcoll-fsdp8-bounded" in names:
        name = f"jaxcoll fsdp8+ep8 buffer {args.buffer_factor}"
        rows[name] = row_jaxcoll(dp.Layout(shard=8, expert=8), None, args.buffer_factor)
    if "jaxcoll-ddp8" in names:
        rows["jaxcoll ddp8+ep8"] = row_jaxcoll(dp.Layout(replicate=8, expert=8))
    if "gspmd" in names:
        rows["gspmd gshard"], dropped = row_gspmd(gshard_moe)
    if "gspmd-ragged" in names:
        rows["gspmd ragged_dot"] = row_gspmd(ragged_moe)[0]
    for name, r in rows.items():  # the first step (the step-0 loss) and a warm-up step
        print(f"warm-up: {name}", file=sys.stderr, flush=True)
        r.state, loss = jax.block_until_ready(r.run(r.state))
        r.first_loss = float(loss)
        r.state = jax.block_until_ready(r.run(r.state))[0]
    for _ in range(args.rounds):
        for r in rows.values():
            for _ in range(args.steps):
                t = time.perf_counter()
                r.state = jax.block_until_ready(r.run(r.state))[0]
                r.times.append(time.perf_counter() - t)

    count = sum(x.size for x in jax.tree.leaves(nn.unbox(init_params())))
    capacity = capacity_of(SEQ, K, EXPERTS, args.capacity_factor)
    print(
        f"MoE: {LAYERS} blocks, width {WIDTH}, {EXPERTS} experts of hidden {HIDDEN}, top-{K}, "
        f"vocabulary {VOCAB}, batch {BATCH} x {SEQ} tokens, {count / 1e6:.2f}M params; "
        f"GSPMD capacity factor {args.capacity_factor} ({capacity} per expert per sequence); "
        f"jax {jax.__version__}, 8 simulated CPU devices on {os.cpu_count()} cores; median of "
        f"{args.rounds} interleaved rounds x {args.steps} steps\n"
    )
    print(
        "| row | ms/step | args MiB | temp MiB | peak MiB | GFLOP/device | step-0 loss | "
        "collectives per step (count x result MiB, per device) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    ms: dict[str, float] = {}
    peak: dict[str, float] = {}
    for name, r in rows.items():
        m = r.compiled.memory_analysis()
        a, t = m.argument_size_in_bytes / MIB, m.temp_size_in_bytes / MIB
        ms[name], peak[name] = 1e3 * statistics.median(r.times), a + t
        print(
            f"| {name} | {ms[name]:.1f} | {a:.2f} | {t:.2f} | {a + t:.2f} | "
            f"{hlo_stats.flops(r.compiled) / 1e9:.3f} | {r.first_loss:.6f} | "
            f"{hlo_stats.summary(r.compiled)} |"
        )
    print()
    if dropped is not None:
        print(f"gspmd dropped at step 0: {100 * dropped:.3f}% of the assignments")
    gspmd = rows.get("gspmd gshard")
    for name, r in rows.items():
        if gspmd is None or name.startswith("gspmd gshard"):
            continue
        diff = abs(r.first_loss - gspmd.first_loss)
        verdict = "match" if diff <= 1e-5 * abs(gspmd.first_loss) else "DIFFER"
        print(
            f"step-0 loss: {name} {r.first_loss:.7f}, gspmd gshard {gspmd.first_loss:.7f}, "
            f"|diff| {diff:.1e}: {verdict}"
        )
    pairs = [(a, b) for b in rows if b.startswith("gspmd") for a in rows if a.startswith("jaxcoll")]
    if pairs:
        print("\n| jaxcoll / GSPMD | time | peak memory |\n|---|---:|---:|")
        for a, b in pairs:
            print(f"| {a} / {b} | {ms[a] / ms[b]:.2f}x | {peak[a] / peak[b]:.2f}x |")


if __name__ == "__main__":
    main()
