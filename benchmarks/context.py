"""Per-device memory of a long-sequence step under context parallel, against one device.

    .venv/bin/python benchmarks/context.py                # sequence 4096, degrees 2, 4, 8
    .venv/bin/python benchmarks/context.py --seq 2048 --degrees 8

The model: token and learned position embeddings (width 64), one causal self-attention layer
of 4 heads (``jaxcoll.nn.ParallelSelfAttention``, no biases) with a residual, a head over a
vocabulary of 64, cross-entropy on the next token; 2 sequences a step, AdamW. Each row is a
``dp.Trainer`` step lowered and compiled (nothing is run): ``temp`` is the compiled step's
``memory_analysis().temp_size_in_bytes`` per device, ``args`` its argument bytes. The
single-device row is the same Trainer on a one-device mesh (dense attention, the whole
sequence's scores); a context row splits every sequence over a mesh of ``n`` devices
(``dp.Layout(context="context")``, the same global batch), attention by ring
(``parallel.Ring()``) or Ulysses. The GSPMD row is the same model and optimizer under
``jax.jit`` on the same ``n`` devices as a competent user writes sequence sharding: the batch
placed ``P(None, "context")``, the activations constrained to it after the embedding, after
the attention and at the logits (``jax.lax.with_sharding_constraint``), the params
replicated; XLA's partitioner decides how attention gets the other devices' keys and values.
The bound checked: ring temp <= 1.25 x (single-device temp / n).
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import dp, parallel  # noqa: E402
from jaxcoll import nn as pnn  # noqa: E402

VOCAB, WIDTH, HEADS, BATCH = 64, 64, 4, 2

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--seq", type=int, default=4096)
parser.add_argument("--degrees", default="2,4,8")
args = parser.parse_args()
SEQ = args.seq


class Model(nn.Module):
    method: parallel.Ring | parallel.Ulysses = parallel.Ring()  # noqa: RUF009
    constrain: Any = None  # GSPMD: the activations' sharding constraint

    @nn.compact
    def __call__(self, x):
        c = self.constrain or (lambda h: h)
        h = nn.Embed(VOCAB, WIDTH)(x)
        pos = self.param("wpe", nn.initializers.normal(0.02), (SEQ, WIDTH))
        h = c(h + pos[parallel.context_positions(x.shape[1])])
        attn = pnn.ParallelSelfAttention(HEADS, use_bias=False, causal=True, context=self.method)
        h = c(h + attn(nn.LayerNorm()(h)))
        return c(nn.Dense(VOCAB)(h))


def loss_of(method):
    model = Model(method)

    def loss(params, batch, rng=None):
        logp = jax.nn.log_softmax(model.apply({"params": params}, batch["x"]))
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1)), {}

    return loss


def measure(method, **trainer_kw):
    params = Model().init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    trainer = dp.Trainer(loss_of(method), optax.adamw(1e-3), **trainer_kw)
    state = trainer.init(params, jax.random.key(0))
    batch = {"x": np.zeros((BATCH, SEQ), np.int32), "y": np.zeros((BATCH, SEQ), np.int32)}
    step, abstract = trainer.step_program(state, batch)
    m = step.lower(*abstract).compile().memory_analysis()
    return m.argument_size_in_bytes / 2**20, m.temp_size_in_bytes / 2**20


def measure_gspmd(n):
    """The GSPMD row's (args, temp) MiB per device on n devices."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("context",))
    seq = NamedSharding(mesh, P(None, "context"))
    constrain = functools.partial(
        jax.lax.with_sharding_constraint, shardings=NamedSharding(mesh, P(None, "context"))
    )
    model = Model(constrain=constrain)
    params = Model().init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    tx = optax.adamw(1e-3)
    replicated = NamedSharding(mesh, P())

    def step(params, opt, batch):
        def loss(p):
            logp = jax.nn.log_softmax(model.apply({"params": p}, batch["x"]))
            return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))

        grads = jax.grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    opt = tx.init(params)
    batch = {"x": np.zeros((BATCH, SEQ), np.int32), "y": np.zeros((BATCH, SEQ), np.int32)}
    rep = jax.tree.map(lambda _: replicated, (params, opt))
    jitted = jax.jit(step, in_shardings=(*rep, {"x": seq, "y": seq}), out_shardings=rep)
    m = jitted.lower(params, opt, batch).compile().memory_analysis()
    return m.argument_size_in_bytes / 2**20, m.temp_size_in_bytes / 2**20


MiB = 2**20
single_mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
args0, temp0 = measure(parallel.Ring(), mesh=single_mesh)
print(f"sequence {SEQ}, batch {BATCH}, width {WIDTH}, {HEADS} heads; per device, compiled\n")
print("| row | args MiB | temp MiB | temp / (single temp / n) |")
print("|---|---:|---:|---:|")
print(f"| one device (dense attention) | {args0:.2f} | {temp0:.2f} | - |")
bounds = []
for n in [int(d) for d in args.degrees.split(",")]:
    for name, method in (("ring", parallel.Ring()), ("ulysses", parallel.Ulysses())):
        if name == "ulysses" and HEADS % n:
            continue
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("context",))
        a, t = measure(method, mesh=mesh, layout=dp.Layout(context="context"))
        ratio = t / (temp0 / n)
        print(f"| context {n}, {name} | {a:.2f} | {t:.2f} | {ratio:.2f}x |")
        if name == "ring":
            bounds.append((n, ratio))
    a, t = measure_gspmd(n)
    row = f"context {n}, GSPMD (sequence sharded, constrained)"
    print(f"| {row} | {a:.2f} | {t:.2f} | {t / (temp0 / n):.2f}x |")
print()
for n, ratio in bounds:
    verdict = "holds" if ratio <= 1.25 else "MISSED"
    print(f"bound: ring at context {n}: temp {ratio:.2f}x (single / {n}) <= 1.25x: {verdict}")
