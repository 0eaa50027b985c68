"""A character-level GPT trained in any layout: data x FSDP x tensor x pipeline parallel.

    python examples/gpt.py                          # dp8: 8 simulated CPU devices, ~20 s
    python examples/gpt.py --layout fsdp4xtp2       # FSDP over 4 x tensor parallel over 2
    python examples/gpt.py --layout fsdp2xtp2xpp2   # ... x 2 pipeline stages (GPipe)
    python examples/gpt.py --layout fsdp2xtp2xpp2:1f1b2  # ... by 1F1B, 2 micro-batches
    python examples/gpt.py --layout fsdp2xcp2xtp2   # ... each sequence split over 2 (ring)
    python examples/gpt.py --layout fsdp8 --experts 8    # an MoE GPT, one expert per device
    python examples/gpt.py --layout fsdp4xpp2:1f1b2 --experts 8  # ... in 2 pipeline stages
    python examples/gpt.py --layout single          # the same model on one device
    python examples/gpt.py --layout dp2xfsdp4 --sync diloco8  # DiLoCo: 2 replicas meet every 8
    jaxcoll-run --nprocs 2 --devices-per-proc 4 examples/gpt.py --layout fsdp2xtp2xpp2

nanoGPT's model and recipe at CPU size: causal self-attention and an MLP per block (pre-
LayerNorm, residuals), learned positions, tied input and output embeddings, AdamW with weight
decay on the matrices only, linear warmup then cosine decay, gradient clipping at 1.0 and
gradient accumulation. The corpus is made here (no download): sentences drawn from a small
grammar, so a character model can learn it in a few hundred steps, written as nanoGPT's
prepare.py writes its corpora: ``train.bin`` and ``val.bin``, the characters' ids as uint16,
in ``--data DIR``. Training reads them through ``dp.TokenBatches`` (grain): every window of
``BLOCK + 1`` characters, a new order each epoch, each process reading only its own rows of
each batch; batch s is the same whatever the layout or the number of processes.

``--layout`` is a ``dp.Layout``'s short name (``dp.Layout.parse``), the roles' degrees and
the schedule: ``dp`` (data replicas), ``fsdp`` (data shards: FSDP, or HSDP beside ``dp``),
``cp`` (context parallel: each sequence split over the devices, ring attention over the
whole), ``tp`` (tensor parallel: the attention heads and the MLP's hidden units split,
jaxcoll.nn's layers) and ``pp`` (pipeline stages over the stacked blocks, run by
parallel.pipeline_loss), then the schedule and its micro-batches: ``:gpipe2`` (the default),
``:1f1b2`` or ``:zb2``; ``single`` is one device. The model is written once and names no mesh
axis: its layers split over the role "tensor", its stacked blocks carry the logical axis
"layers", and the layout maps both to its mesh (or to none: on one device it runs dense).
Every layout trains the same model to the same params as ``--layout single``
(tests/test_gpt.py checks it within 1e-5). ``--experts E`` makes each block's MLP a mixture
of E experts (jaxcoll.nn.MoE: top-2 of E, each expert half the dense MLP's width, dropless,
its load-balancing loss added), the experts split over the data shards (the replicas without
fsdp): ``fsdp8 --experts 8`` holds one expert per device, FSDP holds the rest. With a
pipeline each stage's blocks hold their experts over the stage's data shards, and each stage
adds its load-balancing loss over each pipeline micro-batch to that micro-batch's loss
(``parallel.pipeline_loss(..., has_aux=True)``): the aux loss is then that of each pipeline
micro-batch, the j-th contiguous part of each data replica's rows (``:1f1b1``, one micro-batch,
trains ``single``'s params; tests/parallel/test_pipeline_moe.py). The loop is
``Trainer.fit``, as nanoGPT's: every ``--eval-every`` steps it evaluates on train and val
batches and prints both losses, the learning rate, tokens/s and (with ``--peak-flops``) MFU.
With ``--ckpt DIR`` a run resumes from the newest checkpoint in DIR, in its own layout
whatever layout wrote it, and saves there when the validation loss improves and at the last
step. Logs come from process 0 only. ``--sync diloco8`` trains semi-synchronously
(``dp.sync.DiLoCo(every=8, warmup=50)``, its outer step Nesterov with lr 0.8 and momentum
0.3, the inner AdamW at three times the rates: ``SEMISYNC_LR_SCALE``, ``SEMISYNC_WARMUP``):
after 50 synchronous steps each data replica (the layout's ``dp`` degree; FSDP within a
replica where it has ``fsdp``) steps on its own params and the replicas meet every 8 steps,
the evaluations on the params of their last meeting; ``localsgd8``
averages them instead, and ``:int8`` (``diloco8:int8``) sends the pseudo-gradients in 8 bits
(benchmarks/diloco.py measures them against synchronous training).
Expect the validation loss to fall from about 3.4 (a uniform guess over the 31 characters) to
about 0.5 in 300 steps (dp8: 1.20 at step 100, 0.48 at step 300).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile

# A CPU run simulates the devices the layouts need; jaxcoll-run sets its own per process.
if "JAXCOLL_NUM_PROCESSES" not in os.environ and "device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxcoll  # noqa: E402

jaxcoll.init()  # joins the job jaxcoll-run describes; nothing in a plain run

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxcoll import dp, parallel  # noqa: E402
from jaxcoll import nn as pnn  # noqa: E402

# ----------------------------------------------------------------------------- config
BLOCK = 32  # context length (characters)
LAYERS = 4  # transformer blocks (stacked: a pipeline splits them into stages)
HEADS = 4  # attention heads (a tensor axis splits them)
WIDTH = 64  # embedding width
BIAS = False  # biases in the Linears and LayerNorms (nanoGPT's bias flag; False is faster)
BATCH = 32  # global batch, in sequences, per optimizer step
ACCUM = 2  # gradient accumulation: micro-batches per step (global rows j::ACCUM)
MICRO = 2  # pipeline micro-batches per micro-batch (a pp layout that names no schedule)
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 20  # peak and final learning rate, warmup steps
DECAY_STEPS = 300  # the cosine reaches MIN_LR here (nanoGPT's lr_decay_iters)
WEIGHT_DECAY, CLIP = 0.1, 1.0
STEPS = 300  # optimizer steps to run (--steps; a resumed run goes on to this step)
EVAL_EVERY, EVAL_BATCHES = 50, 4
EXPERTS = 0  # --experts: each block's MLP a mixture of this many experts (0: dense)
AUX = 0.01  # the MoE load-balancing loss's weight
ROUTER_STD = 0.02


def use_tiny() -> None:
    """``--tiny``: a smoke run's model (2 blocks of width 32, 16 characters of context, 16
    sequences a step), compiled and run in seconds; the tests train it."""
    global BLOCK, LAYERS, WIDTH, BATCH
    BLOCK, LAYERS, WIDTH, BATCH = 16, 2, 32, 16


# ----------------------------------------------------------------------------- corpus
def corpus(chars: int = 200_000, seed: int = 0) -> str:
    """Sentences from a small grammar: a corpus a character model learns in minutes."""
    rng = np.random.default_rng(seed)
    words = {
        "det": ["the", "a", "every", "one", "no"],
        "adj": ["small", "quiet", "bright", "old", "quick", "distant", "cold", "green"],
        "noun": ["rank", "device", "mesh", "model", "gradient", "stage", "layer", "host"],
        "verb": ["sends", "reduces", "gathers", "holds", "splits", "trains", "waits for"],
        "adv": ["slowly", "at once", "again", "in order", "twice"],
    }
    pick = lambda k: words[k][rng.integers(len(words[k]))]  # noqa: E731
    out, size = [], 0
    while size < chars:
        s = " ".join(pick(k) for k in ("det", "adj", "noun", "verb", "det", "noun"))
        if rng.random() < 0.5:
            s += f" {pick('adv')}"
        s = s[0].upper() + s[1:] + ".\n"
        out.append(s)
        size += len(s)
    return "".join(out)


TEXT = corpus()
VOCAB = sorted(set(TEXT))
DATA = os.path.join(tempfile.gettempdir(), "jaxcoll-gpt")  # --data: where the .bin files go


def prepare(directory: str) -> None:
    """nanoGPT's prepare.py: the corpus as token files, ``train.bin`` (the first 90%) and
    ``val.bin``, each character's id as uint16, one after another. Every process may call
    it: a file is written whole under another name and renamed, so none reads half of one."""
    tokens = np.array([VOCAB.index(c) for c in TEXT], np.uint16)
    split = int(0.9 * len(tokens))
    os.makedirs(directory, exist_ok=True)
    for name, part in (("train", tokens[:split]), ("val", tokens[split:])):
        path = os.path.join(directory, f"{name}.bin")
        if not os.path.exists(path) or os.path.getsize(path) != part.nbytes:
            part.tofile(f"{path}.{os.getpid()}")
            os.replace(f"{path}.{os.getpid()}", path)


def data(split: str, seed: int, sharding=None) -> dp.TokenBatches:
    """The global batches of ``split``: every window of BLOCK + 1 characters of its file
    (``stride=1``: nanoGPT's random offsets, each once an epoch), in an order drawn from
    ``seed``. With ``sharding`` (the Trainer's batch sharding), each process reads only the
    rows its devices hold."""
    prepare(DATA)
    windows = dp.TokenWindows(os.path.join(DATA, f"{split}.bin"), BLOCK, stride=1)
    return dp.TokenBatches(windows, BATCH, seed=seed, sharding=sharding)


def batches(split: str, count: int, seed: int):
    """The first ``count`` global batches of ``data(split, seed)``, whole, as NumPy: input
    ``x``, next-character target ``y`` and each window's ``id``."""
    batches = data(split, seed)
    return (batches[s] for s in range(count))


# ------------------------------------------------------------------------------ model
class Block(nn.Module):
    """Pre-LayerNorm transformer block; its attention and MLP split over the layout's tensor
    axis where it has one (jaxcoll.nn), dense otherwise."""

    @nn.compact
    def __call__(self, h):
        attn = pnn.ParallelSelfAttention(HEADS, use_bias=BIAS, causal=True)
        h = h + attn(nn.LayerNorm(use_bias=BIAS)(h))
        if EXPERTS:  # top-2 of EXPERTS experts, each half as wide: the dense MLP's FLOPs
            mlp = pnn.MoE(
                EXPERTS, hidden=2 * WIDTH, k=2, router_init=nn.initializers.normal(ROUTER_STD)
            )
        else:
            mlp = pnn.ParallelMLP(features=WIDTH, hidden=4 * WIDTH, use_bias=BIAS)
        return h + mlp(nn.LayerNorm(use_bias=BIAS)(h))


def stage(blocks, h):
    """This stage's blocks in order (all of them when nothing splits the stack)."""
    return jax.lax.scan(lambda h, p: (Block().apply({"params": p}, h), None), h, blocks)[0]


def moe_stage(blocks, h):
    """This stage's blocks in order, its load-balancing loss (weighted: the pipeline adds it
    to the micro-batch's loss and differentiates it through the routers) and the metrics of
    its mixtures of experts (their load over the micro-batch, over every data replica)."""

    def block(h, p):
        h, sown = Block().apply({"params": p}, h, mutable=["intermediates"])
        return h, sown["intermediates"]

    h, sown = jax.lax.scan(block, h, blocks)
    stacked = jax.tree_util.tree_leaves(sown, is_leaf=lambda v: isinstance(v, parallel.Load))
    count = stacked[0].aux.shape[0]  # this stage's blocks
    loads = [jax.tree_util.tree_map(lambda a, i=i: a[i], stacked[0]) for i in range(count)]
    metrics = parallel.moe_metrics(loads)
    return h, (AUX * metrics["moe_aux"], metrics)


def moe_report(metrics):
    """The step's MoE metrics from every stage's on every micro-batch (leaves (stages,
    micro-batches)): the layers' aux losses summed (a micro-batch's mean), the dropped share
    averaged (every stage and micro-batch routes as many assignments), the worst imbalance."""
    return {
        "moe_aux": jnp.mean(jnp.sum(metrics["moe_aux"], 0)),
        "moe_dropped": jnp.mean(metrics["moe_dropped"]),
        "moe_imbalance": jnp.max(metrics["moe_imbalance"]),
    }


def head_loss(head, h, y):
    """The final LayerNorm, the tied output head and the loss of one micro-batch (the last
    pipeline stage runs it)."""
    h = nn.LayerNorm(use_bias=BIAS).apply({"params": head["ln_f"]}, h)
    logp = jax.nn.log_softmax(h @ head["wte"].T)  # tied embeddings
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def loss_fn(params, batch, rng):
    x = batch["x"]
    # The positions of this device's tokens: with a context axis each device holds its part
    # of every sequence (the load-balanced order); otherwise 0 .. T-1.
    h = params["wte"][x] + params["wpe"][parallel.context_positions(x.shape[1])]
    # The stacked blocks as stages over the layout's pipeline axis, by its schedule's own
    # backward, the head on the last stage; with no pipeline axis, every block in order, then
    # the head.
    head = {"ln_f": params["ln_f"], "wte": params["wte"]}
    if EXPERTS:  # each stage's load-balancing loss added to each micro-batch's loss
        loss, metrics = parallel.pipeline_loss(
            moe_stage, head_loss, params["blocks"], head, h, batch["y"], has_aux=True
        )
        metrics = moe_report(metrics)
        return loss, {"lm_loss": loss - AUX * metrics["moe_aux"], **metrics}
    return parallel.pipeline_loss(stage, head_loss, params["blocks"], head, h, batch["y"]), {}


def init_params(seed: int = 0):
    """The params, each boxed with its logical axes (``nn.Partitioned``): the tensor splits
    jaxcoll.nn's layers declare, and the stacked blocks' leading axis, ``"layers"``. A
    Trainer's layout maps them to its mesh axes (to none where it has no such role)."""
    k = jax.random.split(jax.random.key(seed), LAYERS + 2)
    h = jnp.zeros((1, BLOCK, WIDTH))
    per_layer = [Block().init(key, h)["params"] for key in k[:LAYERS]]
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    blocks = jax.tree_util.tree_map(
        lambda *xs: (
            nn.Partitioned(jnp.stack([x.value for x in xs]), ("layers",) + xs[0].names)
            if is_box(xs[0])
            else nn.Partitioned(jnp.stack(xs), ("layers",) + (None,) * xs[0].ndim)
        ),
        *per_layer,
        is_leaf=is_box,
    )
    return {
        "wte": jax.random.normal(k[-2], (len(VOCAB), WIDTH)) * 0.02,
        "wpe": jax.random.normal(k[-1], (BLOCK, WIDTH)) * 0.02,
        "blocks": blocks,
        "ln_f": nn.LayerNorm(use_bias=BIAS).init(k[0], h)["params"],
    }


def optimizer(lr_scale: float = 1.0):
    """AdamW (decay on the matrices only: embeddings and kernels, not biases or norms),
    warmup + cosine (:func:`schedule`, its rates times ``lr_scale``), clipping at 1.0."""

    def decay(params):
        def matrix(path, x):
            stacked = any(getattr(p, "key", None) == "blocks" for p in path)
            return x.ndim - stacked >= 2

        return jax.tree_util.tree_map_with_path(matrix, params)

    return optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(schedule(lr_scale), b1=0.9, b2=0.95, weight_decay=WEIGHT_DECAY, mask=decay),
    )


def schedule(lr_scale: float = 1.0):
    """The learning rate of the update with count c: ``schedule()(c)`` (step c + 1)."""
    return optax.warmup_cosine_decay_schedule(
        0.0, LR * lr_scale, WARMUP, DECAY_STEPS, MIN_LR * lr_scale
    )


# ---------------------------------------------------------------------------- layouts
def layout(name: str) -> dp.Layout:
    """The ``dp.Layout`` a ``--layout`` names (``fsdp4xtp2``, ``dp2xtp2xpp2:1f1b2``,
    ``single``, ...): ``dp.Layout.parse``; a pipeline without a schedule runs GPipe."""
    try:
        parsed = dp.Layout.parse(name)
        parsed.make_mesh()  # the degrees against the devices there are
    except ValueError as e:
        raise SystemExit(f"--layout {name!r}: {e}") from None
    if parsed.replicate is None and parsed.shard is None:
        raise SystemExit(f"--layout {name!r}: name a data role too (dp1 for none)")
    if parsed.pipeline and parsed.schedule is None:
        parsed = dataclasses.replace(parsed, schedule=parallel.GPipe(MICRO))
    if EXPERTS:  # the experts over the data shards (the replicas without them)
        parsed = dataclasses.replace(parsed, expert=parsed.shard or parsed.replicate)
    return parsed


#: ``--precision``: what the params are gathered and computed in and what the gradients
#: travel in; fp32 master params and AdamW state in every case.
PRECISIONS = {
    "fp32": {},
    "bf16": {"mp_policy": dp.sync.MixedPrecisionPolicy(jnp.bfloat16, reduce_dtype=jnp.float32)},
    "fp8-params": {"quantize": dp.Quantize(params=jnp.float8_e4m3fn)},
    "int8-grads": {"quantize": dp.Quantize(grads=jnp.int8)},
}


#: ``--sync``: semi-synchronous training across the data replicas, every N steps.
SYNCS = {"diloco": dp.sync.DiLoCo, "localsgd": dp.sync.LocalSGD}
#: Semi-synchronous recipe (benchmarks/diloco.py measures it). The first SEMISYNC_WARMUP
#: steps synchronous (DiLoCo starts from a trained model in its paper; from scratch, the
#: replicas' early steps diverge most). Then the replicas' inner AdamW at three times the
#: synchronous rates: each replica steps on its share of the batch and the meeting averages
#: their changes, whose noise partly cancels, so the replicas move less far together than one
#: step on the whole batch does. DiLoCo's outer step: Nesterov, lr 0.8 and momentum 0.3; the
#: paper's (0.7, 0.9), chosen for meetings hundreds of steps apart, overshoots at 8.
SEMISYNC_LR_SCALE = 3.0
SEMISYNC_WARMUP = 50
OUTER_LR, OUTER_MOMENTUM = 0.8, 0.3


def lr_scale(sync: str) -> float:
    """The inner rates' factor of a ``--sync``: 1 for ``auto``, else ``SEMISYNC_LR_SCALE``."""
    return 1.0 if sync == "auto" else SEMISYNC_LR_SCALE


def semisync(name: str, shard: bool):
    """The strategy a ``--sync`` names (``diloco8``, ``localsgd4``, ``diloco8:int8``): the
    replicas meet every N steps; within each, DDP (FSDP where the layout has ``shard``)."""
    m = re.fullmatch(r"(diloco|localsgd)(\d+)(:int8)?", name)
    if m is None:
        raise SystemExit(
            f"--sync {name!r}: auto, or diloco8 / localsgd8 (the replicas meet every 8 steps), "
            f"with :int8 for 8-bit pseudo-gradients (diloco8:int8)"
        )
    inner = dp.sync.FSDP() if shard else dp.sync.DDP()
    quantize = dp.Quantize(grads=jnp.int8) if m[3] else None
    kwargs = {"inner": inner, "every": int(m[2]), "quantize": quantize, "warmup": SEMISYNC_WARMUP}
    if m[1] == "diloco":
        kwargs["outer"] = optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    try:
        return SYNCS[m[1]](**kwargs)
    except ValueError as e:
        raise SystemExit(f"--sync {name!r}: {e}") from None


def trainer_for(name: str, precision: str = "fp32", sync: str = "auto") -> dp.Trainer:
    """The Trainer of a ``--layout``; ``single``: the same model on one device. ``sync``:
    ``auto`` (the layout's own strategy) or a ``--sync`` name (:func:`semisync`)."""
    if precision not in PRECISIONS:
        raise SystemExit(f"--precision {precision!r}: one of {sorted(PRECISIONS)}")
    strategy = None
    if PRECISIONS[precision]:
        if not layout(name).shard:
            raise SystemExit(f"--precision {precision}: needs a layout with fsdp (FSDP's gathers)")
        if sync != "auto":
            raise SystemExit(f"--precision {precision}: with --sync auto only")
        strategy = dp.sync.FSDP(**PRECISIONS[precision])
    if sync != "auto":
        strategy = semisync(sync, bool(layout(name).shard))
        inner = optimizer(lr_scale(sync))
        try:
            return dp.Trainer(loss_fn, inner, layout=layout(name), sync=strategy, accum_steps=ACCUM)
        except ValueError as e:
            raise SystemExit(f"--sync {sync!r} on --layout {name!r}: {e}") from None
    return dp.Trainer(loss_fn, optimizer(), layout=layout(name), sync=strategy, accum_steps=ACCUM)


def main(argv=None) -> None:
    global DATA, EXPERTS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--layout",
        default="dp8",
        help="a layout's name, e.g. fsdp4xtp2 or fsdp2xtp2xpp2:1f1b2 (single: one device)",
    )
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument(
        "--precision",
        default="fp32",
        help=f"with fsdp: one of {', '.join(PRECISIONS)} (bf16 compute, 8-bit gathers or "
        f"gradients; fp32 master state)",
    )
    parser.add_argument(
        "--sync",
        default="auto",
        help="auto (the layout's strategy), or diloco8 / localsgd8: the data replicas meet "
        "every 8 steps (diloco8:int8: 8-bit pseudo-gradients)",
    )
    parser.add_argument(
        "--ckpt", help="a directory: resume from its newest checkpoint, save the best and last"
    )
    parser.add_argument("--out", help="write the final params here (.npz, process 0)")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument(
        "--experts", type=int, default=0, help="each MLP a mixture of this many experts"
    )
    parser.add_argument(
        "--data", default=DATA, help="where train.bin and val.bin are (written if missing)"
    )
    parser.add_argument(
        "--eval-every", type=int, default=EVAL_EVERY, help="steps between evaluations (0: none)"
    )
    parser.add_argument(
        "--peak-flops",
        default=None,
        help="one device's peak FLOP/s for the MFU (a number, or 'measure')",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        use_tiny()
    DATA, EXPERTS = args.data, args.experts
    me = jax.process_index()
    trainer = trainer_for(args.layout, args.precision, args.sync)
    state = trainer.init(init_params(), jax.random.key(0))
    if me == 0:
        count = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        print(
            f"{args.layout}: mesh {dict(trainer.mesh.shape)}, {count / 1e3:.0f}k params, "
            f"{len(VOCAB)} characters"
        )
    # nanoGPT's loop as fit: evaluate on train AND val every --eval-every steps (the same
    # batches each time), save when the validation loss improves and at the last step,
    # log the learning rate, tokens/s and MFU. A run with --ckpt resumes from its newest
    # checkpoint, in this run's layout whatever layout wrote it.
    evals = None
    if args.eval_every:
        evals = {
            "train": list(batches("train", EVAL_BATCHES, seed=3)),
            "val": list(batches("val", EVAL_BATCHES, seed=2)),
        }
    peak = args.peak_flops
    peak = float(peak) if peak not in (None, "measure") else peak
    callbacks: list = [dp.Throughput(tokens_per_example=BLOCK, peak_flops=peak)]
    if evals:
        callbacks.append(dp.Evaluate(evals, every=args.eval_every))
    callbacks.append(Log(me, schedule(lr_scale(args.sync))))
    if args.ckpt and evals:
        callbacks.append(dp.SaveBest("eval_val_loss"))
    # Each process reads only its rows of every batch (grain, ahead of the step); batch s
    # depends on s alone, so a resumed run, in any layout, sees the batches it would have.
    state, _ = trainer.fit(
        state,
        data("train", seed=1, sharding=trainer.batch_sharding),
        steps=args.steps,
        checkpoint=dp.Checkpointer(args.ckpt, every=args.steps) if args.ckpt else None,
        callbacks=callbacks,
        progress=False,
    )
    params = trainer.host_params(state)  # collective: every process takes part
    if args.out and me == 0:
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        np.savez(args.out, **{jax.tree_util.keystr(p): x for p, x in flat})


class Log(dp.Callback):
    """Process 0 prints each evaluation: nanoGPT's line, with the step's rate and MFU."""

    def __init__(self, me: int, lr) -> None:
        self.me, self.lr = me, lr
        self.last: dict = {}

    def on_step(self, step, metrics):
        self.last = metrics

    def on_eval(self, step, results):
        if self.me != 0:
            return
        m = self.last
        mfu = f", mfu {m['mfu']:.1%}" if "mfu" in m else ""
        # with experts the loss holds the load-balancing term: print the model's own loss
        lm = "_lm_loss" if "val_lm_loss" in results else "_loss"
        moe = ""
        if "moe_imbalance" in m:
            moe = f", experts' busiest {float(m['moe_imbalance']):.2f}x the mean"
        print(
            f"step {step}: train loss {results['train' + lm]:.3f}, val loss "
            f"{results['val' + lm]:.3f}, lr {float(self.lr(step - 1)):.2e}, "
            f"{m.get('tokens_per_s', 0):.0f} tokens/s{mfu}{moe}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
