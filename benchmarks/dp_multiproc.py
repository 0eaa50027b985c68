"""Data-parallel training over real processes: dp.Trainer (2 processes x 4 devices) vs torch DDP.

    PYTHONPATH=. .venv/bin/python benchmarks/dp_multiproc.py            # ~11 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/dp_multiproc.py --rounds 1 --steps 3     # quick
    PYTHONPATH=. .venv/bin/python benchmarks/dp_multiproc.py --no-torch --configs jax-zero1
    PYTHONPATH=. .venv/bin/python benchmarks/dp_multiproc.py \
        --configs jax-plain,torch-plain,jax-nosync,torch-nosync     # where the time goes
    PYTHONPATH=. .venv/bin/python benchmarks/dp_multiproc.py --model gpt   # sharded, many leaves

An MLP 784-4096-4096-10 (20.0 M float32 params, 80 MB of gradients), synthetic data (inputs
from a 16-dimensional latent, labels from a fixed random linear teacher of the latent; a new
batch every step), global batch 64, SGD lr 0.02 momentum 0.9, everything float32. Rows:

* jaxcoll, started with ``jaxcoll-run --nprocs 2 --devices-per-proc 4`` (8 simulated CPU
  devices, gloo between them; every process calls ``jaxcoll.init()``): ``dp.Trainer`` plain
  (``sync=dp.sync.DDP()``: all-reduce, 25 MiB buckets), bf16 gradients
  (``dp.sync.DDP(hook=dp.hooks.Compress(jnp.bfloat16))``), PowerSGD rank 4
  (``dp.sync.DDP(hook=dp.hooks.PowerSGD(rank=4, start_iter=2))``), ZeRO-1
  (``dp.sync.ZeRO1()``) and FSDP (``dp.sync.FSDP()``). An installed jaxcoll without
  ``Trainer(sync=...)`` skips the jaxcoll rows with a note.
* torch DDP, gloo, 8 processes on 127.0.0.1 (``torch.set_num_threads(1)`` each), the same
  model, initial weights, batches (8 examples per rank) and optimizer: plain, with
  ``bf16_compress_hook``, and with ``powerSGD_hook`` (``PowerSGDState(process_group=None,
  matrix_approximation_rank=4, start_powerSGD_iter=2)``, 2 being the smallest start torch
  allows with error feedback; one 256 MiB bucket, see ``torch_worker``). Needs torch
  (``pip install torch==2.13.0``); ``--no-torch`` runs the jaxcoll rows alone.
* attribution rows, only when named in ``--configs``: ``jax-nosync`` (a jitted shard_map step,
  each device updating on its own gradients: no collective at all) and ``torch-nosync`` (DDP
  under ``no_sync()``), wrong on purpose: what a step costs besides the sync; and
  ``jax-powersgd-s0``, PowerSGD compressing from step 0 (``start_iter=0``: no ``lax.cond``
  between the exact and the compressed average in the step; torch allows no start below 2).

``--model gpt``: the sharded strategies on a model of many medium leaves. A GPT of nanoGPT's
small character configuration (vocabulary 65, context 64, 6 layers, 6 heads, width 384),
written in plain JAX in this file (``gpt_loss``): no biases, parameter-free per-layer
LayerNorms, a scaled final one, the output layer tied to the token embedding: 27 leaves of
10.7 M float32 params (42.7 MB of gradients). Synthetic sequences (each counts up modulo 65
by its own stride from a random start), global batch 8 sequences (one per device), the same
SGD. Rows: ``jax-plain`` (DDP), ``jax-zero1`` (ZeRO-1: its reduce-scatters and all-gathers
by 25 MiB buckets) and ``jax-fsdp`` (FSDP); on request ``jax-nosync`` and
``jax-zero1-perleaf`` (``ZeRO1(bucket_mb=None)``: one reduce-scatter and one all-gather per
leaf, as ZeRO-1 ran before its buckets); no torch rows. Measured on 2 shared CPU cores
(other jobs running: load 6-10), ``--model gpt --rounds 4 --steps 5 --configs
jax-plain,jax-zero1,jax-fsdp,jax-nosync``, 398 s::

    | configuration               | step ms | p25-p75 ms | vs jax plain | MB params+opt/dev |
    | jaxcoll DDP (all-reduce)    |  1503.5 |  1399-1677 |        1.00x |              85.3 |
    | jaxcoll ZeRO-1              |  1389.0 |  1105-1487 |        0.92x |              48.0 |
    | jaxcoll FSDP                |  1735.6 |  1252-2009 |        1.15x |              10.7 |
    | (jaxcoll, no gradient sync) |   498.7 |    353-593 |        0.33x |              85.3 |

ZeRO-1's compiled step: 2 reduce-scatters and 2 all-gathers (two 25 MiB buckets) where
``bucket_mb=None`` has 27 of each; FSDP (its params gathered per leaf) 27 of each. The same
command with ``--rounds 3 --configs jax-plain,jax-zero1,jax-zero1-perleaf``: DDP 1317.5 ms,
ZeRO-1 1524.3 ms (1.16x), ZeRO-1 ``bucket_mb=None`` 1776.1 ms (1.35x); with ``--rounds 2``
(DDP, ZeRO-1, FSDP): 1.00x, 1.19x, 1.09x. On these loaded cores a ratio moves by about 0.2
from run to run.

Method. The configurations run in ``--rounds`` interleaved rounds (jax, torch, jax, torch, ...,
the order rotated by one every round) so that load from other work on a shared machine falls
on every row alike. Every launch is a fresh job: ``--warmup`` steps (compilation, PowerSGD's
start), then ``--steps`` timed steps, each waited for; a step's time is the slowest process's
(rank's) wall time for it. A row's step time is the median over all rounds' timed steps.

Bytes sent per device per step, one formula for both sides, a ring's traffic per device for a
collective whose full (unsharded) payload is S bytes over n ranks: all-reduce 2(n-1)/n * S;
all-gather, reduce-scatter and all-to-all (n-1)/n * S; collective-permute S. jaxcoll: from the
collectives of the compiled step (``trainer.step_program`` -> ``lower().compile().as_text()``),
their shapes and replica groups as XLA will run them (so a bf16 all-reduce that XLA:CPU
widens to float32 counts as float32). torch: plain DDP all-reduces every gradient once (its
buckets hold all of them: S = the gradients' bytes); the hook rows count the tensors every
``torch.distributed.all_reduce`` call gets during the timed steps (bf16 buckets; PowerSGD's P
and Q matrices and the uncompressed biases).

Also printed: per-device resident state (params + optimizer state; jaxcoll: the bytes of the
arrays' shards on the first local device; torch: one rank's params + momentum buffers) and the
loss of the global batch at the last step (same initial weights and data on both sides, so
jax plain and torch plain agree to float32 rounding; PowerSGD is lossy: compare its loss).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = (784, 4096, 4096, 10)
BATCH = 64
# --model gpt: nanoGPT's small character model (vocab 65, context 64, 6 layers, 6 heads,
# width 384), without biases and with parameter-free per-layer LayerNorms: 27 leaves
# (4 matrices per layer, the token and position embeddings, the final LayerNorm's scale),
# 10.7 M float32 params; the output layer is the token embedding (tied).
GPT_VOCAB, GPT_BLOCK, GPT_LAYERS, GPT_HEADS, GPT_EMBD = 65, 64, 6, 6, 384
GPT_BATCH = 8  # sequences per global batch: one per device
GPT_CONFIGS = (
    "jax-plain",
    "jax-zero1",
    "jax-fsdp",
    "jax-nosync",
    "jax-zero1-perleaf",
    "jax-fsdp-perleaf",
    "jax-hsdp",
)
PROCS, DEVICES_PER_PROC = 2, 4
WORLD = PROCS * DEVICES_PER_PROC
JAX_CONFIGS = (
    "jax-plain",
    "jax-bf16",
    "jax-powersgd",
    "jax-zero1",
    "jax-fsdp",
    "jax-nosync",
    "jax-powersgd-s0",
    "jax-zero1-perleaf",
    "jax-fsdp-perleaf",
    "jax-hsdp",
)
TORCH_CONFIGS = ("torch-plain", "torch-bf16", "torch-powersgd", "torch-nosync")
# Interleaved: each jax row next to its torch counterpart.
ORDER = (
    "jax-plain",
    "torch-plain",
    "jax-bf16",
    "torch-bf16",
    "jax-powersgd",
    "torch-powersgd",
    "jax-zero1",
    "jax-fsdp",
)
LABELS = {
    "jax-plain": "jaxcoll DDP (all-reduce)",
    "jax-bf16": "jaxcoll bf16 gradients",
    "jax-powersgd": "jaxcoll PowerSGD rank 4",
    "jax-zero1": "jaxcoll ZeRO-1",
    "jax-zero1-perleaf": "jaxcoll ZeRO-1, bucket_mb=None",
    "jax-fsdp": "jaxcoll FSDP",
    "jax-fsdp-perleaf": "jaxcoll FSDP, bucket_mb=None",
    "jax-hsdp": "jaxcoll HSDP (shard in a process)",
    "torch-plain": "torch DDP",
    "torch-bf16": "torch DDP bf16_compress_hook",
    "torch-powersgd": "torch DDP powerSGD_hook rank 4",
    "jax-nosync": "(jaxcoll, no gradient sync)",
    "jax-powersgd-s0": "(jaxcoll PowerSGD from step 0)",
    "torch-nosync": "(torch DDP under no_sync())",
}
LOSSY = {"jax-powersgd", "torch-powersgd", "jax-powersgd-s0"}
# Attribution rows, not in the default set: the same step without any collective (wrong on
# purpose), i.e. what the step costs on these cores besides gradient synchronisation.
DIAGNOSTIC = {"jax-nosync", "torch-nosync", "jax-powersgd-s0"}
DTYPE_BYTES = {
    "f64": 8,
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s64": 8,
    "u64": 8,
    "s32": 4,
    "u32": 4,
    "s16": 2,
    "u16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (launches per row)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per launch")
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps per launch first (compile; past PowerSGD's start_iter=2)",
    )
    p.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated rows, run in this order (default {','.join(ORDER)}; with "
        f"--model gpt jax-plain,jax-zero1,jax-fsdp)",
    )
    p.add_argument("--no-torch", action="store_true", help="jaxcoll rows only")
    p.add_argument(
        "--model",
        choices=("mlp", "gpt"),
        default="mlp",
        help="mlp: the 784-4096-4096-10 MLP (every row); gpt: a 27-leaf GPT of 10.7 M "
        "params (rows jax-plain, jax-zero1, jax-fsdp; default those three)",
    )
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument(
        "--launch-timeout",
        type=float,
        default=420.0,
        help="seconds one launch may take before it is killed",
    )
    p.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--hlo", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------- shared: model, data
def init_params():
    """numpy params, ``l{i}: {w: (in, out), b: (out,)}``; the torch ranks load the same."""
    import numpy as np

    rng = np.random.default_rng(0)
    return {
        f"l{i}": {
            "w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "b": np.zeros(b, np.float32),
        }
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True))
    }


def make_batches(count: int, latent: int = 16):
    """``count`` global batches of a learnable synthetic task: x = z @ M / sqrt(latent) with
    z ~ N(0, 1) in ``latent`` dimensions and M a fixed random (latent, 784) map, and
    y = argmax(z @ T) for a fixed random teacher T (plain SGD takes the loss from about 2.5
    to about 0.6 in 12 steps)."""
    import numpy as np

    rng = np.random.default_rng(1)
    m = rng.normal(size=(latent, SIZES[0])).astype(np.float32)
    teacher = rng.normal(size=(latent, SIZES[-1])).astype(np.float32)
    out = []
    for s in range(count):
        z = np.random.default_rng(100 + s).normal(size=(BATCH, latent)).astype(np.float32)
        out.append(
            {
                "x": (z @ m) / np.float32(np.sqrt(latent)),
                "y": np.argmax(z @ teacher, axis=1).astype(np.int32),
            }
        )
    return out


def gpt_init_params():
    """numpy params of the GPT: ``wte``, ``wpe``, ``ln_f`` and ``h{i}: {attn_qkv, attn_proj,
    mlp_fc, mlp_proj}`` (27 leaves), normal(0, 0.02) (the LayerNorm scale ones)."""
    import numpy as np

    rng = np.random.default_rng(0)
    c = GPT_EMBD

    def normal(*shape):
        return (0.02 * rng.normal(size=shape)).astype(np.float32)

    params = {
        "wte": normal(GPT_VOCAB, c),
        "wpe": normal(GPT_BLOCK, c),
        "ln_f": np.ones(c, np.float32),
    }
    for i in range(GPT_LAYERS):
        params[f"h{i}"] = {
            "attn_qkv": normal(c, 3 * c),
            "attn_proj": normal(c, c),
            "mlp_fc": normal(c, 4 * c),
            "mlp_proj": normal(4 * c, c),
        }
    return params


def gpt_loss(params, batch, rng=None):
    """The GPT's mean next-token cross-entropy on ``batch = {"x": tokens, "y": next}``."""
    import jax
    import jax.numpy as jnp
    import optax

    idx = batch["x"]
    b, t = idx.shape
    c, nh = GPT_EMBD, GPT_HEADS

    def norm(x):  # LayerNorm without parameters
        mu = x.mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

    def heads(z):
        return z.reshape(b, t, nh, c // nh).transpose(0, 2, 1, 3)

    causal = jnp.tril(jnp.ones((t, t), bool))
    x = params["wte"][idx] + params["wpe"][:t]
    for i in range(GPT_LAYERS):
        p = params[f"h{i}"]
        q, k, v = map(heads, jnp.split(norm(x) @ p["attn_qkv"], 3, axis=-1))
        att = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(c // nh), -jnp.inf)
        y = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
        x = x + y @ p["attn_proj"]
        x = x + jax.nn.gelu(norm(x) @ p["mlp_fc"]) @ p["mlp_proj"]
    logits = (norm(x) * params["ln_f"]) @ params["wte"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def gpt_batches(count: int):
    """``count`` global batches of a learnable token task: each sequence counts up modulo
    the vocabulary by its own stride (1-4) from a random start; ``y`` is ``x`` shifted by
    one."""
    import numpy as np

    out = []
    for s in range(count):
        rng = np.random.default_rng(100 + s)
        start = rng.integers(0, GPT_VOCAB, size=(GPT_BATCH, 1))
        stride = rng.integers(1, 5, size=(GPT_BATCH, 1))
        tokens = (start + stride * np.arange(GPT_BLOCK + 1)) % GPT_VOCAB
        out.append({"x": tokens[:, :-1].astype(np.int32), "y": tokens[:, 1:].astype(np.int32)})
    return out


# ----------------------------------------------------------------------------- bytes from HLO
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(
    r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(-start)?\("
)
_CALLS = re.compile(r"(?:to_apply|calls|body)=%?([\w.\-]+)")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+),\s*"
    r"false_computation=%?([\w.\-]+))"
)
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * DTYPE_BYTES[dtype]
    return total


def _group_size(line: str, world: int) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m and m.group(1):
        return len(m.group(1).split(","))
    return world


def hlo_bytes_sent(hlo: str, world: int) -> dict:
    """Bytes one device sends per step by the ring formulas (module docstring), from the
    collectives of a compiled HLO module reached from its entry computation.

    A conditional whose branches send different amounts counts its cheapest branch in
    ``bytes`` and its dearest in ``bytes_max``; a while loop's body counts once (``loops``).
    """
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0].split("(")[0]:
            name = m.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name is not None:
            comps[name].append(line)
    memo: dict[str, tuple[float, float, list]] = {}
    flags = {"loops": 0, "conditionals": 0}

    def walk(comp: str) -> tuple[float, float, list]:
        if comp in memo:
            return memo[comp]
        memo[comp] = (0.0, 0.0, [])  # recursion guard
        lo = hi = 0.0
        ops: list = []
        for line in comps.get(comp, ()):
            m = _OP.search(line)
            if m:
                shape, op, start = m.group(1), m.group(2), m.group(3)
                out = _shape_bytes(shape)
                if start and shape.startswith("("):
                    # *-start ops return (operand(s), output, ...): take the output part
                    parts = re.findall(r"[a-z]+\d*\[[\d,]*\]", shape)
                    out = (
                        _shape_bytes(parts[len(parts) // 2])
                        if op == "all-gather"
                        else _shape_bytes(parts[-1])
                        if op != "all-reduce"
                        else _shape_bytes(" ".join(parts[len(parts) // 2 :]))
                    )
                n = _group_size(line, world)
                if op == "all-reduce":
                    sent = 2 * (n - 1) / n * out
                elif op == "reduce-scatter":
                    sent = (n - 1) / n * (out * n)
                elif op in ("all-gather", "all-to-all"):
                    sent = (n - 1) / n * out
                else:
                    sent = float(out)
                lo += sent
                hi += sent
                ops.append((op, shape.split("{")[0] if not shape.startswith("(") else shape, n))
            br = _BRANCHES.search(line)
            if br:
                names = (
                    [s.strip().lstrip("%") for s in br.group(1).split(",")]
                    if br.group(1)
                    else [br.group(2), br.group(3)]
                )
                sub = [walk(b) for b in names]
                if len({round(s[0]) for s in sub}) > 1:
                    flags["conditionals"] += 1
                lo += min(s[0] for s in sub)
                hi += max(s[1] for s in sub)
                for s in sub:
                    ops.extend(s[2])
                continue
            for callee in _CALLS.findall(line):
                if " while(" in line:
                    flags["loops"] += 1
                s = walk(callee)
                lo, hi = lo + s[0], hi + s[1]
                ops.extend(s[2])
        memo[comp] = (lo, hi, ops)
        return memo[comp]

    lo, hi, ops = walk(entry) if entry else (0.0, 0.0, [])
    kinds: dict[str, int] = {}
    for op, _, _ in ops:
        kinds[op] = kinds.get(op, 0) + 1
    return {"bytes": lo, "bytes_max": hi, "ops": kinds, **flags}


# ---------------------------------------------------------------------------------- jax worker
def jax_worker(a: argparse.Namespace) -> None:
    import jaxcoll

    jaxcoll.init()  # first: joins the job jaxcoll-run describes

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcoll import distributed as dist
    from jaxcoll import dp

    def forward(params, x):
        for i in range(len(SIZES) - 1):
            x = x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
            if i < len(SIZES) - 2:
                x = jax.nn.relu(x)
        return x

    def mlp_loss(params, batch, rng=None):
        logits = forward(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}

    gpt = a.model == "gpt"
    loss_fn = gpt_loss if gpt else mlp_loss

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    n = mesh.size
    optimizer = optax.sgd(a.lr, momentum=a.momentum)
    sharding = NamedSharding(mesh, P("data"))
    per = (GPT_BATCH if gpt else BATCH) // n
    mine = [k for k, d in enumerate(mesh.devices.reshape(-1)) if d.process_index == me]
    rows = np.concatenate([np.arange(k * per, (k + 1) * per) for k in mine])
    total = a.warmup + a.steps
    batches = [
        {k: jax.make_array_from_process_local_data(sharding, v[rows]) for k, v in b.items()}
        for b in (gpt_batches if gpt else make_batches)(total)
    ]
    params = jax.tree_util.tree_map(jnp.asarray, (gpt_init_params if gpt else init_params)())

    if a.config == "jax-nosync":
        # Attribution only, wrong on purpose: every device steps on its own gradients (no
        # collective at all); the state returned is device 0's.
        rep = NamedSharding(mesh, P())

        def body(state, batch):
            p, o = state
            loss, g = jax.value_and_grad(lambda q: loss_fn(q, batch)[0])(p)
            updates, o = optimizer.update(g, o, p)
            return (optax.apply_updates(p, updates), o), {"loss": loss}

        step = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(), P("data")),
                out_specs=((P(), P()), {"loss": P()}),
                check_vma=False,
            ),
            donate_argnums=0,
        )
        state = jax.device_put((params, optimizer.init(params)), rep)
        run = step
        program = (lambda st, b: (step, (st, b))) if a.hlo else None
        held = state
    else:
        sync = {
            "jax-plain": dp.sync.DDP(),
            "jax-bf16": dp.sync.DDP(hook=dp.hooks.Compress(jnp.bfloat16)),
            "jax-zero1": dp.sync.ZeRO1(),
            "jax-zero1-perleaf": dp.sync.ZeRO1(bucket_mb=None),  # a collective per leaf
            "jax-fsdp": dp.sync.FSDP(),
            "jax-fsdp-perleaf": dp.sync.FSDP(bucket_mb=None),
        }.get(a.config)
        layout = dp.Layout(replicate="data")
        if a.config == "jax-hsdp":  # replicas across the processes, shards within one
            sync = dp.sync.FSDP()
            mesh = jax.make_mesh((PROCS, DEVICES_PER_PROC), ("replica", "shard"))
            layout = dp.Layout(replicate="replica", shard="shard")
        if a.config in ("jax-powersgd", "jax-powersgd-s0"):
            start = 0 if a.config == "jax-powersgd-s0" else 2
            sync = dp.sync.DDP(hook=dp.hooks.PowerSGD(rank=4, start_iter=start))
        assert sync is not None, a.config
        trainer = dp.Trainer(loss_fn, optimizer, mesh=mesh, layout=layout, sync=sync)
        state = trainer.init(params, jax.random.key(0))
        run = trainer.step
        program = trainer.step_program if a.hlo else None
        held = (state.params, state.opt_state)

    dev0 = jax.local_devices()[0]

    def resident(tree) -> int:
        return sum(
            s.data.nbytes
            for leaf in jax.tree_util.tree_leaves(tree)
            if isinstance(leaf, jax.Array)
            for s in leaf.addressable_shards
            if s.device == dev0
        )

    out: dict = {
        "config": a.config,
        "state_bytes": resident(held),
        "all_state_bytes": resident(state),
    }

    times, losses = [], []
    for s in range(total):
        t = time.perf_counter()
        state, metrics = run(state, batches[s])
        jax.block_until_ready((state, metrics))
        if s >= a.warmup:
            times.append(time.perf_counter() - t)
        losses.append(metrics["loss"])
    if program is not None:  # the program of the timed steps (PowerSGD's compressed phase)
        step, args = program(state, batches[0])
        out["hlo"] = hlo_bytes_sent(step.lower(*args).compile().as_text(), n)
    losses = [float(np.asarray(m.addressable_shards[0].data)) for m in losses]
    everyone = dist.all_gather_object(times)
    out["times"] = [max(ts) for ts in zip(*everyone, strict=True)]  # the slowest process
    if a.config != "jax-nosync":
        out["loss"] = losses[-1]
        out["loss_first"] = losses[0]
    if me == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)


# -------------------------------------------------------------------------------- torch worker
def torch_worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist
    from torch import nn

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    tdist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
    )
    layers: list[nn.Module] = []
    params = init_params()
    for i, (fan_in, fan_out) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        lin = nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(params[f"l{i}"]["w"].T.copy()))
            lin.bias.copy_(torch.from_numpy(params[f"l{i}"]["b"]))
        layers.append(lin)
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    if a.config == "torch-powersgd":
        # One bucket: with several, powerSGD_hook's chained all-reduces (P, then Q, issued
        # from the previous one's completion callback) start in a different order on
        # different ranks, and gloo aborts the job on the first mismatched pair ("Received
        # data size doesn't match expected size"). DDP's default, 25 MiB buckets (the first
        # 1 MiB), splits this model into 3.
        model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=256)
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        model.register_comm_hook(
            psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
            ),
            psgd.powerSGD_hook,
        )
    else:
        model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
    if a.config == "torch-bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        # DDP refuses a hook *named* bf16_compress_hook unless CUDA + NCCL are there; the same
        # function under another name runs on gloo, which reduces bfloat16 on CPU.
        def bf16_on_gloo(state, bucket):
            return default_hooks.bf16_compress_hook(state, bucket)

        model.register_comm_hook(None, bf16_on_gloo)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)

    # Count what the hooks hand to all_reduce (torch's built-in DDP path does not call it).
    sent = [0]
    real_all_reduce = tdist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *args, **kwargs)

    tdist.all_reduce = counting_all_reduce
    per = BATCH // world
    total = a.warmup + a.steps
    batches = [
        (
            torch.from_numpy(b["x"][rank * per : (rank + 1) * per]),
            torch.from_numpy(b["y"][rank * per : (rank + 1) * per]).long(),
        )
        for b in make_batches(total)
    ]
    times, losses, payload = [], [], []
    sync = model.no_sync if a.config == "torch-nosync" else contextlib.nullcontext
    for s, (x, y) in enumerate(batches):
        sent[0] = 0
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with sync():
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP all-reduces the bucketed gradients during backward
        opt.step()
        if s >= a.warmup:
            times.append(time.perf_counter() - t)
            payload.append(sent[0])
        losses.append(loss.detach())
    tdist.all_reduce = real_all_reduce
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t_all = torch.tensor(times, dtype=torch.float64)
    tdist.all_reduce(t_all, op=tdist.ReduceOp.MAX)  # the slowest rank, step by step
    lossv = torch.tensor([float(losses[0]), float(losses[-1])], dtype=torch.float64)
    tdist.all_reduce(lossv)  # equal shares: the mean of the ranks' means is the global mean
    if rank == 0:
        n = world
        # the built-in DDP path all-reduces every gradient once, outside Python's all_reduce
        s_bytes = param_bytes if a.config == "torch-plain" else statistics.median(payload)
        momentum = sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if torch.is_tensor(v)
        )
        nosync = a.config == "torch-nosync"
        out = {
            "config": a.config,
            "times": t_all.tolist(),
            "loss": None if nosync else float(lossv[1]) / n,
            "loss_first": None if nosync else float(lossv[0]) / n,
            "state_bytes": param_bytes + momentum,
            "all_state_bytes": None,
            "hlo": {
                "bytes": 2 * (n - 1) / n * s_bytes,
                "payload": s_bytes,
                "ops": {"all-reduce": None},
            },
        }
        with open(a.out, "w") as f:
            json.dump(out, f)
    tdist.destroy_process_group()


# ---------------------------------------------------------------------------------- the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(procs: list[subprocess.Popen], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    if any(p.poll() is None for p in procs):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the group this launch started
                p.wait()
        return 124
    return max(p.returncode for p in procs)


def launch(a: argparse.Namespace, config: str, hlo: bool, tmp: str) -> dict:
    """One fresh job for ``config``; its process 0's result (or ``{"error": ...}``)."""
    out = os.path.join(tmp, f"{config}.json")
    log = os.path.join(tmp, f"{config}.log")
    if os.path.exists(out):
        os.remove(out)
    common = [
        os.path.abspath(__file__),
        "--config",
        config,
        "--out",
        out,
        "--warmup",
        str(a.warmup),
        "--steps",
        str(a.steps),
        "--lr",
        str(a.lr),
        "--momentum",
        str(a.momentum),
        "--model",
        a.model,
    ]
    with open(log, "w") as logf:
        if config.startswith("jax"):
            cmd = [
                sys.executable,
                "-m",
                "jaxcoll.run",
                "--nprocs",
                str(PROCS),
                "--devices-per-proc",
                str(DEVICES_PER_PROC),
                "--timeout",
                "300",
                *common,
                "--worker",
                "jax",
                *(["--hlo"] if hlo else []),
            ]
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            procs = [
                subprocess.Popen(cmd, env=env, stdout=logf, stderr=logf, start_new_session=True)
            ]
        else:
            port = str(_free_port())
            procs = [
                subprocess.Popen(
                    [sys.executable, *common, "--worker", "torch"],
                    env=dict(
                        os.environ,
                        RANK=str(r),
                        WORLD_SIZE=str(WORLD),
                        MASTER_PORT=port,
                        OMP_NUM_THREADS="1",
                    ),
                    stdout=logf,
                    stderr=logf,
                    start_new_session=True,
                )
                for r in range(WORLD)
            ]
        code = _wait(procs, a.launch_timeout)
    if code == 0 and os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    with open(log) as f:
        tail = f.read().splitlines()[-15:]
    return {"error": f"exit {code}", "log": tail}


def available(configs: list[str], no_torch: bool) -> tuple[list[str], list[str]]:
    """The rows that can run here, and a note for each one that cannot."""
    notes, keep = [], []
    jax_ok = {c: True for c in JAX_CONFIGS}
    if any(c.startswith("jax") for c in configs):
        import inspect

        from jaxcoll import dp

        if "sync" not in inspect.signature(dp.Trainer).parameters:
            jax_ok = {c: c == "jax-nosync" for c in JAX_CONFIGS}
    torch_ok = not no_torch
    if not no_torch and any(c.startswith("torch") for c in configs):
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            torch_ok = False
            notes.append(
                "torch is not installed (pip install torch==2.13.0, a CPU wheel): "
                "skipping the torch rows; --no-torch runs the jaxcoll rows alone."
            )
    for c in configs:
        if c not in LABELS:
            raise SystemExit(f"unknown config {c!r}; choose from {', '.join(LABELS)}")
        if c.startswith("jax") and not jax_ok[c]:
            notes.append(f"{c}: the installed jaxcoll has no Trainer(sync=...); row skipped.")
        elif c.startswith("torch") and not torch_ok:
            continue
        else:
            keep.append(c)
    return keep, notes


def _leaves(tree) -> list:
    """The arrays of a nested dict, in key order."""
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in _leaves(tree[k])]
    return [tree]


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def main(a: argparse.Namespace) -> int:
    gpt = a.model == "gpt"
    if a.configs is None:
        a.configs = ",".join(GPT_CONFIGS[:3] if gpt else ORDER)
    named = [c.strip() for c in a.configs.split(",") if c.strip()]
    if gpt and (other := [c for c in named if c not in GPT_CONFIGS]):
        raise SystemExit(
            f"--model gpt runs the rows {', '.join(GPT_CONFIGS)}; got {', '.join(other)}. "
            f"Drop them from --configs, or use --model mlp."
        )
    configs, notes = available(named, a.no_torch)
    for note in notes:
        print(f"note: {note}")
    if not configs:
        return 1
    if gpt:
        import numpy as np

        leaves = _leaves(gpt_init_params())
        nparams = sum(int(np.prod(x.shape)) for x in leaves)
        model = (
            f"GPT (vocab {GPT_VOCAB}, context {GPT_BLOCK}, {GPT_LAYERS} layers, {GPT_HEADS} "
            f"heads, width {GPT_EMBD}; {len(leaves)} leaves, {nparams / 1e6:.1f} M params, "
            f"{4 * nparams / 1e6:.1f} MB float32 gradients), global batch {GPT_BATCH} "
            f"sequences"
        )
    else:
        nparams = sum(i * o + o for i, o in zip(SIZES[:-1], SIZES[1:], strict=True))
        model = (
            f"MLP {'-'.join(map(str, SIZES))} ({nparams / 1e6:.1f} M params, "
            f"{4 * nparams / 1e6:.1f} MB float32 gradients), global batch {BATCH}"
        )
    print(
        f"{model}, SGD lr {a.lr} momentum {a.momentum}; jaxcoll {PROCS} processes x "
        f"{DEVICES_PER_PROC} devices, torch {WORLD} processes x 1 thread, gloo on 127.0.0.1, "
        f"{os.cpu_count()} CPU cores; {a.rounds} interleaved rounds x ({a.warmup} warm-up + "
        f"{a.steps} timed steps)",
        flush=True,
    )
    results: dict[str, dict] = {c: {"times": [], "loss": [], "errors": []} for c in configs}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dp_multiproc_") as tmp:
        for r in range(a.rounds):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for c in order:
                t = time.monotonic()
                res = launch(a, c, hlo=not results[c].get("hlo"), tmp=tmp)
                row = results[c]
                if "error" in res:
                    row["errors"].append(res)
                    print(
                        f"  round {r + 1}: {c} FAILED ({res['error']}):\n    "
                        + "\n    ".join(res["log"]),
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                row["times"].extend(res["times"])
                if res.get("loss") is not None:
                    row["loss"].append(res["loss"])
                for k in ("hlo", "state_bytes", "all_state_bytes", "loss_first"):
                    if res.get(k) is not None:
                        row[k] = res[k]
                print(
                    f"  round {r + 1}/{a.rounds}: {c:15s} median "
                    f"{1e3 * statistics.median(res['times']):8.1f} ms, launch "
                    f"{time.monotonic() - t:5.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    print(f"wall time {time.monotonic() - started:.0f} s")
    report(a, configs, results)
    return 0


def report(a: argparse.Namespace, configs: list[str], results: dict[str, dict]) -> None:
    med = {c: 1e3 * statistics.median(v["times"]) for c, v in results.items() if v["times"]}
    base, tbase = med.get("jax-plain"), med.get("torch-plain")

    def ratio(x, y) -> str:
        return f"{x / y:.2f}x" if y else "-"

    print(
        f"\n| {'configuration':31s} | step ms | p25-p75 ms | vs jax plain | vs torch plain "
        f"| MB sent/dev/step | MB params+opt/dev | MB all state/dev "
        f"| loss @ step {a.warmup + a.steps} |"
    )
    print(
        f"|{'-' * 33}|--------:|-----------:|-------------:|---------------:|"
        f"-----------------:|------------------:|-----------------:|---------------:|"
    )
    for c in configs:
        v = results[c]
        if c not in med:
            print(f"| {LABELS[c]:31s} | failed in every round ({v['errors'][0]['error']}) |")
            continue
        ms = sorted(1e3 * t for t in v["times"])
        q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
        hlo = v.get("hlo", {})
        sent = _mb(hlo.get("bytes"))
        if hlo.get("conditionals"):
            sent += f" ({_mb(hlo['bytes_max'])})"
        loss = f"{statistics.median(v['loss']):.4f}" if v["loss"] else "-"
        print(
            f"| {LABELS[c]:31s} | {med[c]:7.1f} | {f'{q[0]:.0f}-{q[2]:.0f}':>10s} "
            f"| {ratio(med[c], base):>12s} | {ratio(med[c], tbase):>14s} "
            f"| {sent:>16s} | {_mb(v.get('state_bytes')):>17s} "
            f"| {_mb(v.get('all_state_bytes')):>16s} | {loss:>14s} |"
        )
    print(
        "\nMB params+opt/dev: the params' and optimizer state's bytes on one device (jax: "
        "their shards on the first local device; torch: one rank's params + momentum); all "
        "state: every array of jax's TrainState there (hook state included). loss: the "
        "global batch's mean loss at the last step, median over rounds (every launch starts "
        "from the same weights and sees the same batches)."
    )
    for c in configs:
        hlo = results[c].get("hlo", {})
        if c.startswith("jax") and hlo:
            print(
                f"{c}: collectives in the compiled step: {hlo.get('ops')}"
                + (
                    f"; {hlo['conditionals']} conditional(s) whose branches differ: the "
                    f"cheaper branch is counted, the dearer in ()"
                    if hlo.get("conditionals")
                    else ""
                )
            )
        elif c.startswith("torch") and hlo:
            print(f"{c}: all-reduce payload {_mb(hlo.get('payload'))} MB per step")
    print()
    rows = [c for c in med if c not in DIAGNOSTIC]

    def best(side: str, lossy: bool) -> str | None:
        pick = [c for c in rows if c.startswith(side) and (c in LOSSY) == lossy]
        return min(pick, key=med.get) if pick else None

    def goal(ok: bool) -> str:
        return "met" if ok else "NOT met"

    j, t = best("jax", False), best("torch", False)
    if j and t:
        r = med[j] / med[t]
        print(
            f"jaxcoll best lossless ({j}) / torch best lossless ({t}) = {r:.2f} "
            f"(goal <= 0.5: {goal(r <= 0.5)})"
        )
    j2, t2 = best("jax", True), best("torch", True)
    if j2 and t2:
        r = med[j2] / med[t2]
        print(f"jaxcoll PowerSGD / torch PowerSGD = {r:.2f} (goal <= 0.5: {goal(r <= 0.5)})")
    if j2 and base:
        r = base / med[j2]
        print(f"jaxcoll plain / jaxcoll PowerSGD = {r:.2f}x faster (goal >= 2x: {goal(r >= 2)})")
    fsdp = results.get("jax-fsdp", {}).get("state_bytes")
    ddp = results.get("jax-plain", {}).get("state_bytes")
    if fsdp and ddp:
        r = fsdp / ddp
        print(
            f"FSDP / DDP per-device state bytes = {r:.3f} (goal <= 1.2/{WORLD} = "
            f"{1.2 / WORLD:.3f}: {goal(r <= 1.2 / WORLD)})"
        )
    for c in configs:
        if results[c]["errors"]:
            print(f"{c}: {len(results[c]['errors'])} failed launch(es)")


if __name__ == "__main__":
    args = parse_args()
    if args.worker == "jax":
        jax_worker(args)
    elif args.worker == "torch":
        torch_worker(args)
    else:
        raise SystemExit(main(args))
