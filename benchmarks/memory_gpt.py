"""Per-device peak memory of a nanoGPT-shaped GPT written as a Python loop over its blocks.

    .venv/bin/python benchmarks/memory_gpt.py                 # every row, compile only
    .venv/bin/python benchmarks/memory_gpt.py --rows fsdp,zero1

The model is nanoGPT's, written as nanoGPT writes it (a list of blocks applied in a Python
loop, no scan): flax.linen, a token embedding (vocabulary 65, shakespeare_char's) and a learned
position embedding (context 64), 8 blocks of width 512 (8 heads), each block pre-LayerNorm
causal self-attention with a fused ``c_attn`` (512, 1536) and ``c_proj`` (512, 512), then
pre-LayerNorm MLP ``c_fc`` (512, 2048), GELU, ``c_proj`` (2048, 512), residuals around both;
a final LayerNorm and the head tied to the token embedding (``wte.attend``); biases on;
25.3M params (101 MiB in float32). AdamW (``optax.adamw(1e-3)``), 8 simulated CPU devices,
global batch 8 sequences (one per device), cross-entropy on the next token.

Rows: ``dp.Trainer(loss_fn, optax.adamw(1e-3), sync=...)`` with ``dp.sync.FSDP()`` (default
settings), ``dp.sync.FSDP(bucket_mb=None)``, ``dp.sync.ZeRO1()`` and ``dp.sync.DDP()``, on one
mesh axis of 8 devices. Nothing is run: each step is lowered and compiled
(``trainer.step_program(state, batch)``) and its ``memory_analysis()`` read: ``args`` is
``argument_size_in_bytes`` (the state and the batch on one device), ``temp`` is
``temp_size_in_bytes`` and ``args+temp`` their sum, the peak compared.

The ideal FSDP row, per device::

    3 P / 8            # params, Adam's mu and nu, each split 8 ways (P: the params' bytes)
    + B                # one block gathered whole (B: one block's bytes)
    + A                # the activations the backward keeps for this device's examples

``A`` is measured, not estimated: the temp bytes of the loss's gradient (``jax.grad``, jitted)
compiled for one device on one device's examples. The bounds checked: FSDP ``args+temp <= 1.5 x
ideal`` and below ZeRO-1's.
"""

from __future__ import annotations

import argparse
import os
import sys

import jaxcoll

DEVICES = 8
ROWS = ("fsdp", "fsdp-per-leaf", "zero1", "ddp")
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
args = parser.parse_args()
bad = [x for x in args.rows.split(",") if x not in ROWS]
if bad:
    parser.error(f"--rows: unknown {bad}; pick from {ROWS}")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *jaxcoll.xla_cpu_flags(devices=DEVICES)]
).strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxcoll import dp  # noqa: E402

VOCAB, CONTEXT, LAYERS, WIDTH, HEADS = 65, 64, 8, 512, 8
BATCH = 8  # global, in sequences
MIB = 2**20


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
        self.h = [Block() for _ in range(LAYERS)]  # nanoGPT's ModuleList
        self.ln_f = nn.LayerNorm()

    def __call__(self, idx):
        x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[-1]))
        for block in self.h:  # a Python loop: no scan, no stacked params
            x = block(x)
        return self.wte.attend(self.ln_f(x))  # the head tied to the token embedding


MODEL = GPT()


def loss_fn(params, batch, rng=None):
    logits = MODEL.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def peak(trainer: dp.Trainer, params, batch) -> tuple[int, int]:
    state = trainer.init(params, jax.random.key(0))
    step, specs = trainer.step_program(state, batch)
    m = step.lower(*specs).compile().memory_analysis()
    return m.argument_size_in_bytes, m.temp_size_in_bytes


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
    params = jax.device_get(MODEL.init(jax.random.key(0), batch["x"][:1])["params"])
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    block = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["h_0"]))
    acts = activation_bytes(params, batch)
    ideal = 3 * total // DEVICES + block + acts
    count = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"nanoGPT-shaped GPT, {LAYERS} blocks x width {WIDTH} in a Python loop: "
        f"{count / 1e6:.1f}M params ({total / MIB:.1f} MiB), one block {block / MIB:.2f} MiB; "
        f"AdamW, {jax.device_count()} simulated CPU devices, global batch {BATCH} x "
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
    sums = {}
    for row in args.rows.split(","):
        label, make = syncs[row]
        trainer = dp.Trainer(loss_fn, optax.adamw(1e-3), sync=make(), axis_name="data")
        a, t = peak(trainer, params, batch)
        sums[row] = a + t
        print(
            f"| {label:23s} | {a / MIB:8.2f} | {t / MIB:8.2f} | {(a + t) / MIB:9.2f} "
            f"| {(a + t) / ideal:5.2f}x |",
            flush=True,
        )
    print(f"| {'ideal FSDP (computed)':23s} | {'':8s} | {'':8s} | {ideal / MIB:9.2f} | 1.00x |")
    if "fsdp" in sums:
        ok = sums["fsdp"] <= 1.5 * ideal
        line = f"\nbound: FSDP args+temp {sums['fsdp'] / ideal:.2f}x ideal <= 1.5x: "
        print(line + ("holds" if ok else "FAILS"))
        if "zero1" in sums:
            ok = sums["fsdp"] < sums["zero1"]
            print(
                f"bound: FSDP args+temp {sums['fsdp'] / MIB:.2f} MiB < ZeRO-1's "
                f"{sums['zero1'] / MIB:.2f} MiB: {'holds' if ok else 'FAILS'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
