"""Auxiliary-loss-free load balancing against the load-balancing loss: how evenly an MoE GPT's
router spreads the tokens over its experts, at equal steps on the same data.

    .venv/bin/python benchmarks/moe_balance.py --layout single   # 300 steps each, 1 device
    .venv/bin/python benchmarks/moe_balance.py                   # fsdp8, one expert a device
    .venv/bin/python benchmarks/moe_balance.py --steps 100 --rate 0.001

The model: examples/gpt.py's character GPT (its corpus, batches, AdamW, warmup + cosine and
clipping, imported from it) with each block's MLP a ``jaxcoll.nn.MoE`` of 8 experts, top-2,
softmax router, each expert half the dense MLP's width, dropless, written here so that the
layer's ``bias_update_rate`` can be set: pre-LayerNorm blocks of causal self-attention and the
MoE, learned positions, tied embeddings. Two rows, from the same initial params, on the same
batches, in a ``dp.Trainer`` (``--layout``: default ``fsdp8``, the experts over the 8 data
shards, one per device):

- ``aux loss``: the loss is the cross-entropy + ``AUX`` (0.01) x the load-balancing losses of
  the layers (Switch Transformer's ``E * sum_e f_e P_e``, ``parallel.moe_metrics``'s
  ``moe_aux``): the router learns to balance through the gradient.
- ``aux-loss-free``: the cross-entropy alone; each MoE keeps a routing bias (``MoE(...,
  bias_update_rate=RATE)``, DeepSeek-V3): the experts are the top-2 of ``scores + bias``, the
  gates the unbiased scores, and after each step ``bias += RATE * sign(mean load - load)``
  from the whole batch's load. The bias is the Trainer's model state (a ``dp.Model`` that
  applies the model with the ``"moe_bias"`` collection mutable in training).

The table: ``moe_imbalance``, the busiest expert's assignments over the mean (1.0 is perfect
balance; the worst of the layers), averaged over the training batches of each window of
steps, and at the end both runs' language-model loss (the cross-entropy without the
auxiliary term) on the train and the validation batches gpt.py evaluates on.

Measured (``--layout single``, 300 steps, rate 0.01; about 8 minutes a row on a shared
2-core CPU)::

         steps |       aux loss |  aux-loss-free
           1-1 |          3.801 |          3.801
          2-10 |          3.665 |          3.002
         11-25 |          3.212 |          3.399
         26-50 |          2.066 |          2.111
        51-100 |          1.554 |          1.356
       101-200 |          1.536 |          1.267
       201-300 |          1.472 |          1.246
    train loss |          0.465 |          0.455
      val loss |          0.467 |          0.467

The bias needs a few tens of steps to find its level (rate 0.01 a step; its final spread
across a layer's experts 0.12), then keeps the busiest expert at about 1.25x the mean where
the auxiliary loss leaves it at about 1.5x, at the same language-model loss. The default
layout (``fsdp8``, one expert per device; about 5 minutes a row) measures the same: 1.460
against 1.234 over steps 201-300, validation loss 0.466 and 0.469.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import flax.linen as nn  # noqa: E402
import gpt  # noqa: E402  (sets the simulated devices before jax starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxcoll import dp, parallel  # noqa: E402
from jaxcoll import nn as pnn  # noqa: E402

# ----------------------------------------------------------------------------- config
EXPERTS, TOP_K = 8, 2  # experts per MoE and experts per token
AUX = 0.01  # the aux-loss row's load-balancing weight (gpt.py's)
RATE = 0.01  # the aux-loss-free row's bias update rate per step (DeepSeek-V3: 0.001 over far
# more steps; its scores are sigmoids)
STEPS = 300
WINDOWS = (1, 10, 25, 50, 100, 200, 300)  # the table's rows: steps ending each window


class MoEGPT(nn.Module):
    """gpt.py's GPT with an MoE MLP in each block, its routing bias on when ``rate`` is set."""

    rate: float | None = None

    @nn.compact
    def __call__(self, x):
        embed = nn.Embed(len(gpt.VOCAB), gpt.WIDTH, embedding_init=nn.initializers.normal(0.02))
        wpe = self.param("wpe", nn.initializers.normal(0.02), (gpt.BLOCK, gpt.WIDTH))
        h = embed(x) + wpe[: x.shape[1]]
        for _ in range(gpt.LAYERS):
            attn = pnn.ParallelSelfAttention(gpt.HEADS, use_bias=gpt.BIAS, causal=True)
            h = h + attn(nn.LayerNorm(use_bias=gpt.BIAS)(h))
            moe = pnn.MoE(
                EXPERTS,
                hidden=2 * gpt.WIDTH,
                k=TOP_K,
                router_init=nn.initializers.normal(gpt.ROUTER_STD),
                bias_update_rate=self.rate,
            )
            h = h + moe(nn.LayerNorm(use_bias=gpt.BIAS)(h))
        return embed.attend(nn.LayerNorm(use_bias=gpt.BIAS)(h))  # tied output head


class Balanced(dp.Model):
    """The loss (+ ``aux`` x the load-balancing loss) and the MoE metrics; the routing bias,
    if any, is the model state: stepped in training (``rng`` given), read in evaluation."""

    def __init__(self, rate: float | None, aux: float) -> None:
        self.module, self.aux = MoEGPT(rate), aux

    def init(self, rng, batch):
        variables = dict(self.module.init(rng, batch["x"]))
        return variables.pop("params"), variables

    def loss_fn(self, params, model_state, batch, rng):
        train = rng is not None
        mutable = ["intermediates", *model_state] if train else ["intermediates"]
        logits, new = self.module.apply(
            {"params": params, **model_state}, batch["x"], mutable=mutable
        )
        metrics = parallel.moe_metrics(new["intermediates"])
        logp = jax.nn.log_softmax(logits)
        lm = -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], axis=-1))
        new_state = {c: new[c] for c in model_state} if train else model_state
        return lm + self.aux * metrics["moe_aux"], ({"lm_loss": lm, **metrics}, new_state)


def run(name: str, model: Balanced, layout: dp.Layout, steps: int):
    """Train ``steps`` steps; the per-step imbalance, the final train and val losses and the
    final spread of the routing biases (None without)."""
    trainer = dp.Trainer(model, gpt.optimizer(), layout=layout)
    first = next(gpt.batches("train", 1, seed=1))
    params, model_state = model.init(jax.random.key(0), first)  # the same init in both rows
    state = trainer.init(params, jax.random.key(1), model_state=model_state)
    imbalance, start = [], time.perf_counter()
    for batch in gpt.batches("train", steps, seed=1):
        state, metrics = trainer.step(state, batch)
        imbalance.append(float(metrics["moe_imbalance"]))
    evals = {
        split: trainer.evaluate(state, list(gpt.batches(split, gpt.EVAL_BATCHES, seed=s)))
        for split, s in (("train", 3), ("val", 2))
    }
    seconds = time.perf_counter() - start
    bias = state.model_state.get("moe_bias")
    spread = None
    if bias is not None:  # the largest bias gap between two experts of a layer, at the end
        spread = max(float(np.ptp(np.asarray(b))) for b in jax.tree_util.tree_leaves(bias))
    print(f"{name}: {steps} steps in {seconds:.0f} s", file=sys.stderr)
    return imbalance, {k: float(v["lm_loss"]) for k, v in evals.items()}, spread


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--layout", default="fsdp8", help="a dp.Layout name (single: one device)")
    parser.add_argument("--rate", type=float, default=RATE, help="the bias update rate")
    args = parser.parse_args(argv)
    gpt.DECAY_STEPS = max(args.steps, 2 * gpt.WARMUP)  # the cosine ends with the run (300)
    gpt.EXPERTS = EXPERTS  # gpt.layout then puts the experts over the data shards
    layout = gpt.layout(args.layout)
    rows = {
        "aux loss": Balanced(None, AUX),
        "aux-loss-free": Balanced(args.rate, 0.0),
    }
    results = {row: run(row, model, layout, args.steps) for row, model in rows.items()}
    windows = [w for w in WINDOWS if w < args.steps] + [args.steps]
    print(
        f"MoE GPT ({gpt.LAYERS} blocks, width {gpt.WIDTH}, {EXPERTS} experts top-{TOP_K}, "
        f"batch {gpt.BATCH} x {gpt.BLOCK}), layout {args.layout}: moe_imbalance (busiest "
        f"expert / mean, worst layer), mean over the steps of each window"
    )
    print(f"{'steps':>10} | " + " | ".join(f"{row:>14}" for row in rows))
    lo = 0
    for hi in windows:
        cells = [np.mean(results[row][0][lo:hi]) for row in rows]
        print(f"{f'{lo + 1}-{hi}':>10} | " + " | ".join(f"{c:>14.3f}" for c in cells))
        lo = hi
    for split in ("train", "val"):
        cells = [results[row][1][split] for row in rows]
        print(f"{split + ' loss':>10} | " + " | ".join(f"{c:>14.3f}" for c in cells))
    spread = results["aux-loss-free"][2]
    print(
        f"aux-loss-free: rate {args.rate}; its final bias spread (max - min, widest layer) "
        f"{spread:.3f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
