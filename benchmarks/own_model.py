"""Per-device memory of a user's own nnx Llama, unchanged, in five layouts and in plain GSPMD.

    .venv/bin/python benchmarks/own_model.py              # compile only
    .venv/bin/python benchmarks/own_model.py --time 5     # and 5 interleaved timing rounds

The model is ``tests/models/llama_nnx.py`` as its author wrote it (logical sharding names in
its nnx metadata, no collectives, no mesh): vocabulary 1024 (tied head), width 256, 8 query
heads and 2 key/value heads of 32, SwiGLU MLP 1024, 4 blocks; AdamW, global batch 16 x 128
tokens, 8 simulated CPU devices. Each jaxcoll row is ``dp.Trainer(dp.Nnx(model, loss,
call=...), optax.adamw(1e-3), layout=...)``; the pipelined row stacks the same model's blocks
(``jaxcoll.nn.stack_blocks``, ``parallel.pipeline_loss``). The last row is the same model and
AdamW written as a MaxText user writes it: ``jax.jit`` of value_and_grad + the update on a
``("data", "tensor") = (4, 2)`` mesh (Auto axes), the model built under
``nnx.logical_axis_rules`` with embed -> "data" (FSDP-style), heads, kv_heads, mlp,
vocab -> "tensor", kv -> None; the batch split over "data"; the embedding's and each block's
outputs constrained to ``P("data", None, None)`` and the logits to ``P("data", None,
"tensor")`` by ``jax.lax.with_sharding_constraint``; params and optimizer state donated.

How to read the table: nothing is run; each step is lowered and compiled and its
``memory_analysis()`` read, per device: ``args`` (``argument_size_in_bytes``: params, AdamW's
two moments, the batch), ``temp`` (``temp_size_in_bytes``: activations, gathered params,
gradients) and their sum, the peak to compare (GSPMD vs fsdp4xtp2: the same mesh shape).
``q``, ``k``, ``mlp``: the share of all blocks' q, k and MLP kernels one device holds
(read from the state's param shardings; 1/8 = split over every device). With ``--time``:
the median ms/step per row over N rounds, each round a few steps of every row in turn.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import jaxcoll

DEVICES, STEPS = 8, 3  # simulated devices; timed steps per row per round
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--time", type=int, default=0, metavar="N", help="N timing rounds")
args = parser.parse_args()
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *jaxcoll.xla_cpu_flags(devices=DEVICES)]
).strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.models

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import plain_step  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import dp, parallel  # noqa: E402
from jaxcoll import nn as jnn  # noqa: E402
from tests.models import llama_nnx, reference  # noqa: E402

CONFIG = llama_nnx.LlamaConfig(
    vocab_size=1024, d_model=256, n_heads=8, n_kv_heads=2, head_dim=32, mlp_dim=1024, n_layers=4
)
BATCH, SEQ, MIB = 16, 128, 2**20
ROWS = {
    "dp8": dp.Layout.parse("dp8"),
    "fsdp8": dp.Layout.parse("fsdp8"),
    "fsdp4xtp2": dp.Layout.parse("fsdp4xtp2"),
    "dp2xtp4 (kv whole)": dp.Layout(replicate=2, tensor=4, rules={"kv_heads": None}),
    "fsdp2xtp2xpp2:1f1b4": dp.Layout.parse("fsdp2xtp2xpp2:1f1b4"),
}
# logical name -> mesh axis, as a MaxText config writes them
GSPMD_RULES: tuple[tuple[str, str | None], ...] = (("embed", "data"), ("kv", None))
GSPMD_RULES += tuple((name, "tensor") for name in ("heads", "kv_heads", "mlp", "vocab"))
KERNELS = {"q": ("['q']", "kernel"), "k": ("['k']", "kernel"), "mlp": ("['mlp']", "kernel")}


def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def jaxcoll_row(layout: dp.Layout):
    """The glue a port writes (tests/models/test_layouts.py), AdamW: trainer and state."""
    with dp.building():
        model = llama_nnx.Llama(CONFIG, rngs=nnx.Rngs(0))

    def call(m, batch, *, train, rngs):
        return m(batch["tokens"], batch["positions"])

    model_loss = dp.Nnx(model, lambda logits, b: (loss(logits, b), {}), call=call)
    trainer = dp.Trainer(model_loss, optax.adamw(1e-3), layout=layout)
    params, model_state = model_loss.init()
    return trainer, trainer.init(params, jax.random.key(1), model_state=model_state)


def pipelined_row(layout: dp.Layout):
    """The same model's blocks as pipeline stages, the model file unchanged."""
    with dp.building():
        model = llama_nnx.Llama(CONFIG, rngs=nnx.Rngs(0))
    stack = jnn.stack_blocks(model.layers)
    rest = stack.rest(model)

    def head(rest_params, h, batch):
        m: Any = rest.module(rest_params)
        return loss(m.embed.attend(m.final_norm(h)).astype(np.float32), batch)

    def loss_fn(params, batch, rng):
        m: Any = rest.module(params["rest"])
        h = m.embed(batch["tokens"])
        side = {"positions": batch["positions"]}
        blocks, other = params["blocks"], params["rest"]
        return parallel.pipeline_loss(stack.stage_fn, head, blocks, other, h, batch, side=side), {}

    trainer = dp.Trainer(loss_fn, optax.adamw(1e-3), layout=layout)
    params = {"blocks": stack.params, "rest": rest.params}
    specs = {"blocks": stack.specs, "rest": rest.specs}
    return trainer, trainer.init(params, jax.random.key(1), specs=specs)


def gspmd_row(batch):
    """MaxText-style GSPMD: (step, compiled, params, opt_state, placed batch)."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    act = NamedSharding(mesh, P("data", None, None))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(GSPMD_RULES):
        model = llama_nnx.Llama(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-3)
    shardings = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
    replicated, params_sh = NamedSharding(mesh, P()), shardings(params)
    opt_sh = optax.tree_map_params(  # the moments sharded as their params, the count replicated
        opt,
        lambda _, s: s,
        jax.eval_shape(opt.init, params),
        params_sh,
        transform_non_params=lambda _: replicated,
    )
    opt_state = jax.jit(opt.init, out_shardings=opt_sh)(params)

    def loss_fn(p, b):
        m = nnx.merge(graphdef, p)
        h = jax.lax.with_sharding_constraint(m.embed(b["tokens"]), act)
        for block in m.layers:
            h = jax.lax.with_sharding_constraint(block(h, b["positions"]), act)
        logits = m.embed.attend(m.final_norm(h)).astype(np.float32)
        logits = jax.lax.with_sharding_constraint(
            logits, NamedSharding(mesh, P("data", None, "tensor"))
        )
        return loss(logits, b), {}

    batch_sh = NamedSharding(mesh, P("data"))
    step = plain_step.jit_step(loss_fn, opt, params_sh, opt_sh, batch_sh, replicated)
    placed = jax.device_put(batch, batch_sh)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(GSPMD_RULES):
        compiled = step.lower(params, opt_state, placed).compile()
    return step, compiled, params, opt_state, placed, mesh


def share(params, key: tuple[str, str]) -> Fraction:
    """The share of the matching kernels' elements the first device holds."""
    held = whole = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if all(k in name for k in key):
            held += x.addressable_shards[0].data.size
            whole += x.size
    return Fraction(held, whole)


def row_line(label: str, compiled, params) -> str:
    m = compiled.memory_analysis()
    a, t = m.argument_size_in_bytes, m.temp_size_in_bytes
    shares = " | ".join(f"{str(share(params, k)):>4s}" for k in KERNELS.values())
    return f"| {label:21s} | {a / MIB:8.2f} | {t / MIB:8.2f} | {(a + t) / MIB:9.2f} | {shares} |"


def timed(run) -> float:
    """ms/step of ``STEPS`` calls of ``run()`` (which returns the loss)."""
    start = time.perf_counter()
    for _ in range(STEPS):
        value = run()
    jax.block_until_ready(value)
    return (time.perf_counter() - start) / STEPS * 1e3


def main() -> int:
    batches = list(reference.batches(STEPS + 1, batch=BATCH, seq=SEQ, vocab=CONFIG.vocab_size))
    batch = batches[0]
    with dp.building():
        count = sum(
            x.size for x in jax.tree.leaves(nnx.state(llama_nnx.Llama(CONFIG, rngs=nnx.Rngs(0))))
        )
    print(
        f"nnx Llama {CONFIG.n_layers} blocks x width {CONFIG.d_model}, {CONFIG.n_heads} q / "
        f"{CONFIG.n_kv_heads} kv heads, vocab {CONFIG.vocab_size}: {count / 1e6:.2f}M params "
        f"({count * 4 / MIB:.1f} MiB); AdamW, batch {BATCH} x {SEQ}, {jax.device_count()} "
        f"simulated CPU devices; jax {jax.__version__}\n"
    )
    print("| row                   | args MiB | temp MiB | args+temp |    q |    k |  mlp |")
    print("|-----------------------|---------:|---------:|----------:|-----:|-----:|-----:|")
    sums, runners = {}, {}
    for label, layout in ROWS.items():
        make = pipelined_row if layout.pipeline else jaxcoll_row
        trainer, state = make(layout)
        step, specs = trainer.step_program(state, batch)
        compiled = step.lower(*specs).compile()
        m = compiled.memory_analysis()
        sums[label] = m.argument_size_in_bytes + m.temp_size_in_bytes
        print(row_line(label, compiled, state.params), flush=True)
        runners[label] = [trainer, state]
    step, compiled, params, opt_state, placed, mesh = gspmd_row(batch)
    m = compiled.memory_analysis()
    sums["gspmd"] = m.argument_size_in_bytes + m.temp_size_in_bytes
    print(row_line("GSPMD data4 x tensor2", compiled, params), flush=True)
    ratio = sums["fsdp4xtp2"] / sums["gspmd"]
    print(f"\nfsdp4xtp2 / GSPMD (same 4 x 2 mesh) args+temp: {ratio:.2f}x")
    if args.time:
        gspmd_state = [params, opt_state]

        def run_gspmd():
            with jax.set_mesh(mesh), nnx.logical_axis_rules(GSPMD_RULES):
                gspmd_state[0], gspmd_state[1], value = step(*gspmd_state, placed)
            return value

        def run_jaxcoll(label):
            def run():
                runners[label][1], metrics = runners[label][0].step(runners[label][1], batch)
                return metrics["loss"]

            return run

        runs = {label: run_jaxcoll(label) for label in ROWS} | {"GSPMD data4 x tensor2": run_gspmd}
        for run in runs.values():  # compile and warm up
            jax.block_until_ready(run())
        times: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(args.time):  # rows interleaved: A, B, ..., A, B, ...
            for label, run in runs.items():
                times[label].append(timed(run))
        print(f"\nmedian ms/step over {args.time} rounds of {STEPS} steps:")
        for label, ms in times.items():
            print(f"  {label:22s} {float(np.median(ms)):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
