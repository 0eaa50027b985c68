"""Per-device peak memory of a nanoGPT-shaped GPT written as a Python loop over its blocks.

    .venv/bin/python benchmarks/memory_gpt.py                 # every row, compile only
    .venv/bin/python benchmarks/memory_gpt.py --rows fsdp,zero1
    .venv/bin/python benchmarks/memory_gpt.py --rows fsdp --recipe nanogpt   # nanoGPT's recipe

The model is nanoGPT's, written as nanoGPT writes it (a list of blocks applied in a Python
loop, no scan): flax.linen, a token embedding (vocabulary 65, shakespeare_char's) and a learned
position embedding (context 64), 8 blocks of width 512 (8 heads), each block pre-LayerNorm
causal self-attention with a fused ``c_attn`` (512, 1536) and ``c_proj`` (512, 512), then
pre-LayerNorm MLP ``c_fc`` (512, 2048), GELU, ``c_proj`` (2048, 512), residuals around both;
a final LayerNorm and the head tied to the token embedding (``wte.attend``); biases on;
25.3M params (101 MiB in float32). AdamW (``optax.adamw(1e-3)``; nanoGPT's recipe with
``--recipe nanogpt``, below), 8 simulated CPU devices, global batch 8 sequences (one per
device), cross-entropy on the next token.

Rows: ``dp.Trainer(loss_fn, optimizer, sync=...)`` with ``dp.sync.FSDP()`` (default
settings), ``dp.sync.FSDP(bucket_mb=None)``, ``dp.sync.ZeRO1()`` and ``dp.sync.DDP()``, on one
mesh axis of 8 devices; and the same model and AdamW in plain JAX: ``GSPMD FSDP (naive)``
(``jax.jit`` of value_and_grad + the update, params and state placed by ``NamedSharding``,
each leaf split over 8 along the dimension jaxcoll's FSDP picks, the batch split, donated)
and ``GSPMD FSDP (competent)``, the same written as MaxText writes it: the embedding's, each
block's and the logits' outputs constrained by ``jax.lax.with_sharding_constraint`` to the
batch over the devices, and each block under ``jax.checkpoint`` (``nn.remat``) with the
policy that saves every activation, as jaxcoll's FSDP rematerialises (it saves everything
but the gathered params). Nothing is run: each step is lowered and compiled
(``trainer.step_program(state, batch)``) and its ``memory_analysis()`` read: ``args`` is
``argument_size_in_bytes`` (the state and the batch on one device), ``temp`` is
``temp_size_in_bytes`` and ``args+temp`` their sum, the peak compared.

The ideal FSDP row, per device::

    3 P / 8            # params, Adam's mu and nu, each split 8 ways (P: the params' bytes)
    + B                # one block gathered whole (B: one block's bytes)
    + A                # the activations the backward keeps for this device's examples

``A`` is measured, not estimated: the temp bytes of the loss's gradient (``jax.grad``, jitted)
compiled for one device on one device's examples. torch FSDP2's footprint for the same
step, per device::

    4 P / 8            # params, gradients, Adam's mu and nu, each split 8 ways
    + 2 B              # the block in use and the one prefetched, gathered whole
    + A

The bounds checked: FSDP ``args+temp <= 1.5 x ideal``, ``<=`` FSDP2's footprint, and below
ZeRO-1's. With ``--hlo``: each row's FLOPs and the collectives of its compiled per-device
program (``benchmarks/hlo_stats.py``).

``--recipe nanogpt`` trains as nanoGPT trains instead of with ``optax.adamw(1e-3)``:
``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95,
weight_decay=0.1, mask=...))``, the decay on the params of two dimensions or more only and
the schedule a linear warmup then cosine decay (``optax.warmup_cosine_decay_schedule``).
Measured (jax 0.10.2, XLA:CPU, jaxcoll's flags), jaxcoll FSDP args + temp per device:
``adamw`` 36.17 + 49.51 = 85.69 MiB, ``nanogpt`` 36.17 + 48.51 = 84.69 MiB (FSDP2's
footprint 88.92 MiB; with ``FSDP(prefetch=False)``, one block gathered at a time,
36.17 + 36.51 = 72.69 MiB). Where the peak is (XLA's buffer assignment, dumped with
``XLA_FLAGS=--xla_dump_to=DIR``: ``*-live-range.txt`` lists the values live at the peak):
the backward's start, every block's saved activations alive (about 24 MiB: per block the
MLP's pre-activation, its tanh and its GELU output, 512 KiB each, and about ten (64, 512)
values) and two blocks' re-gathered matrices (20 MiB: the last block's and the prefetched
one's); the gradients are not yet made and the optimizer's temporaries come later.
"""

from __future__ import annotations

import argparse
import os
import sys

import jaxcoll

DEVICES = 8
ROWS = ("fsdp", "fsdp-per-leaf", "zero1", "ddp", "gspmd", "gspmd-competent")
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
parser.add_argument("--hlo", action="store_true", help="print each row's collectives")
parser.add_argument(
    "--recipe",
    choices=("adamw", "nanogpt"),
    default="adamw",
    help="adamw: optax.adamw(1e-3); nanogpt: nanoGPT's (decay on matrices, clipping, schedule)",
)
args = parser.parse_args()
bad = [x for x in args.rows.split(",") if x not in ROWS]
if bad:
    parser.error(f"--rows: unknown {bad}; pick from {ROWS}")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *jaxcoll.xla_cpu_flags(devices=DEVICES)]
).strip()

import flax.linen as nn  # noqa: E402
import hlo_stats  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import plain_step  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import dp  # noqa: E402
from jaxcoll.dp.sync.base import mirror_specs  # noqa: E402
from jaxcoll.dp.sync.fsdp import fsdp_dim  # noqa: E402

VOCAB, CONTEXT, LAYERS, WIDTH, HEADS = 65, 64, 8, 512, 8
BATCH = 8  # global, in sequences
MIB = 2**20
#: The competent GSPMD row's activation sharding (the batch over the devices), set while its
#: step is traced; None for every other row.
ACT: list = [None]


def act(x):
    """``x`` constrained to the batch over the devices in the competent GSPMD row."""
    return x if ACT[0] is None else jax.lax.with_sharding_constraint(x, ACT[0])


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        t, d = x.shape[-2:]
        q, k, v = jnp.split(nn.Dense(3 * d, name="c_attn")(x), 3, axis=-1)

        def heads(z):
            return z.reshape(*z.shape[:-1], HEADS, d // HEADS).swapaxes(-2, -3)

        q, k, v = heads(q), heads(k), heads(v)
        att = (q @ k.swapaxes(-1, -2)) / np.sqrt(d // HEADS)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
        y = jax.nn.softmax(att, axis=-1) @ v
        y = y.swapaxes(-2, -3).reshape(*x.shape)
        return nn.Dense(d, name="c_proj")(y)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(4 * x.shape[-1], name="c_fc")(x))
        return nn.Dense(x.shape[-1], name="c_proj")(h)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + Attention(name="attn")(nn.LayerNorm(name="ln_1")(x))
        return x + MLP(name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT(nn.Module):
    def setup(self):
        self.wte = nn.Embed(VOCAB, WIDTH)
        self.wpe = nn.Embed(CONTEXT, WIDTH)
        block = Block
        if ACT[0] is not None:  # the competent GSPMD: each block under jax.checkpoint
            block = nn.remat(Block, policy=jax.checkpoint_policies.everything_saveable)
        self.h = [block() for _ in range(LAYERS)]  # nanoGPT's ModuleList
        self.ln_f = nn.LayerNorm()

    def __call__(self, idx):
        x = act(self.wte(idx) + self.wpe(jnp.arange(idx.shape[-1])))
        for block in self.h:  # a Python loop: no scan, no stacked params
            x = act(block(x))
        return act(self.wte.attend(self.ln_f(x)))  # the head tied to the token embedding


def loss_fn(params, batch, rng=None):
    logits = GPT().apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def optimizer() -> optax.GradientTransformation:
    """``--recipe``'s optimizer: ``optax.adamw(1e-3)``, or nanoGPT's recipe (``nanogpt``):
    global-norm clipping at 1.0, then AdamW (b2 0.95, weight decay 0.1 on the params of two
    dimensions or more only) on a linear warmup then cosine decay of the learning rate."""
    if args.recipe == "adamw":
        return optax.adamw(1e-3)
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 5000, 1e-4)
    decay = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay),
    )


def peak(trainer: dp.Trainer, params, batch):
    state = trainer.init(params, jax.random.key(0))
    step, specs = trainer.step_program(state, batch)
    return step.lower(*specs).compile()


def gspmd(params, batch, competent: bool):
    """Plain-JAX FSDP: ``jax.jit`` of value_and_grad + the AdamW update, params and state
    placed by ``NamedSharding`` (each leaf split over 8 along the dimension jaxcoll's FSDP
    picks), the batch split, params and state donated; ``competent``: the embedding's, each
    block's and the logits' outputs constrained to the batch over the devices and each block
    under ``jax.checkpoint`` (saving every activation), as MaxText writes it."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    opt = optimizer()

    def spec(x):
        d = fsdp_dim(np.shape(x), DEVICES)
        return P() if d is None else P(*[None] * d, "data")

    specs = jax.tree.map(spec, params)
    o_specs = mirror_specs(jax.eval_shape(opt.init, params), params, specs)
    named = lambda t: jax.tree.map(  # noqa: E731
        lambda s: NamedSharding(mesh, s), t, is_leaf=lambda s: isinstance(s, P)
    )
    p_sh, o_sh = named(specs), named(o_specs)

    step = plain_step.jit_step(
        loss_fn, opt, p_sh, o_sh, NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    )
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
        (params, jax.eval_shape(opt.init, params), batch),
        (p_sh, o_sh, jax.tree.map(lambda _: NamedSharding(mesh, P("data")), batch)),
    )
    ACT[0] = NamedSharding(mesh, P("data", None, None)) if competent else None
    try:
        return step.lower(*abstract).compile()
    finally:
        ACT[0] = None


def activation_bytes(params, batch) -> int:
    """The scratch XLA needs for the loss's gradient on one device's examples (its compiled
    ``memory_analysis()`` temp bytes: the activations the backward keeps, and its work
    space; the params are the arguments and the gradient the output)."""
    local = jax.tree.map(lambda x: x[: BATCH // DEVICES], batch)
    grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, b)[0]))
    return grad.lower(params, local).compile().memory_analysis().temp_size_in_bytes


def main() -> int:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(BATCH, CONTEXT + 1)).astype(np.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    params = jax.device_get(GPT().init(jax.random.key(0), batch["x"][:1])["params"])
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    block = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["h_0"]))
    acts = activation_bytes(params, batch)
    ideal = 3 * total // DEVICES + block + acts
    fsdp2 = 4 * total // DEVICES + 2 * block + acts
    count = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"nanoGPT-shaped GPT, {LAYERS} blocks x width {WIDTH} in a Python loop: "
        f"{count / 1e6:.1f}M params ({total / MIB:.1f} MiB), one block {block / MIB:.2f} MiB; "
        f"{args.recipe} recipe, {jax.device_count()} simulated CPU devices, global batch {BATCH} x "
        f"{CONTEXT} tokens; jax {jax.__version__}\n"
        f"ideal FSDP {ideal / MIB:.2f} MiB per device = 3 P/8 {3 * total / DEVICES / MIB:.2f}"
        f" + one block {block / MIB:.2f} + activations {acts / MIB:.2f}\n"
    )
    print("| row                     | args MiB | temp MiB | args+temp | /ideal |")
    print("|-------------------------|---------:|---------:|----------:|-------:|")
    syncs = {
        "fsdp": ("jaxcoll FSDP", dp.sync.FSDP),
        "fsdp-per-leaf": ("jaxcoll FSDP per leaf", lambda: dp.sync.FSDP(bucket_mb=None)),
        "zero1": ("jaxcoll ZeRO-1", dp.sync.ZeRO1),
        "ddp": ("jaxcoll DDP", dp.sync.DDP),
    }
    sums, hlo = {}, []
    for row in args.rows.split(","):
        if row.startswith("gspmd"):
            competent = row == "gspmd-competent"
            label = f"GSPMD FSDP ({'competent' if competent else 'naive'})"
            compiled = gspmd(params, batch, competent)
        else:
            label, make = syncs[row]
            trainer = dp.Trainer(loss_fn, optimizer(), sync=make())
            compiled = peak(trainer, params, batch)
        m = compiled.memory_analysis()
        a, t = m.argument_size_in_bytes, m.temp_size_in_bytes
        sums[row] = a + t
        hlo.append(
            f"{label}: {hlo_stats.flops(compiled) / 1e9:.3f} GFLOP/device; "
            + hlo_stats.summary(compiled)
        )
        print(
            f"| {label:23s} | {a / MIB:8.2f} | {t / MIB:8.2f} | {(a + t) / MIB:9.2f} "
            f"| {(a + t) / ideal:5.2f}x |",
            flush=True,
        )
    print(f"| {'ideal FSDP (computed)':23s} | {'':8s} | {'':8s} | {ideal / MIB:9.2f} | 1.00x |")
    print(
        f"| {'FSDP2 footprint (comp.)':23s} | {'':8s} | {'':8s} | {fsdp2 / MIB:9.2f} "
        f"| {fsdp2 / ideal:5.2f}x |"
    )
    if "fsdp" in sums:
        ok = sums["fsdp"] <= 1.5 * ideal
        line = f"\nbound: FSDP args+temp {sums['fsdp'] / ideal:.2f}x ideal <= 1.5x: "
        print(line + ("holds" if ok else "FAILS"))
        ok = sums["fsdp"] <= fsdp2
        print(
            f"bound: FSDP args+temp {sums['fsdp'] / MIB:.2f} MiB <= FSDP2's footprint "
            f"{fsdp2 / MIB:.2f} MiB (4 P/8 + 2 blocks + activations): "
            + ("holds" if ok else "FAILS")
        )
        if "zero1" in sums:
            ok = sums["fsdp"] < sums["zero1"]
            print(
                f"bound: FSDP args+temp {sums['fsdp'] / MIB:.2f} MiB < ZeRO-1's "
                f"{sums['zero1'] / MIB:.2f} MiB: {'holds' if ok else 'FAILS'}"
            )
        for row in ("gspmd-competent", "gspmd"):
            if row in sums:
                print(f"jaxcoll FSDP / {row}: memory {sums['fsdp'] / sums[row]:.2f}x")
    if args.hlo:
        print("\n" + "\n".join(hlo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
