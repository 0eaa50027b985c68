"""Pipeline schedules inside a dp.Trainer step: compiled memory, bubble and step time.

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_schedules.py          # ~2 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_schedules.py --rows 8192 --rounds 0

The model: an input projection, 8 residual MLP layers (width 128, 4x hidden) stacked and split
into 4 stages over a ``pipe`` axis, an output projection and a squared error; 8 simulated
devices as data 2 x pipe 4; ``--rows`` examples per data replica per step (1024), split into
``--micro`` micro-batches (16). Rows, one Trainer step each (``Trainer.step_program``, compiled,
nothing run):

* ``pipeline_apply``: the GPipe forward differentiated by jax (what a Trainer loss ran before
  schedules were values): every micro-batch's activations inside every stage are kept;
* ``pipeline_loss(GPipe(M))``, ``pipeline_loss(OneFOneB(M))``,
  ``pipeline_loss(Interleaved(M, virtual=2))``, ``pipeline_loss(ZeroBubble(M))``: the
  schedule's own backward behind a ``jax.custom_vjp`` (stage inputs kept, each stage's
  forward recomputed in its backward).

Columns: the compiled step's temp and argument bytes per device (``memory_analysis()``), the
schedule's bubble (``bubble_fraction``, in its own slots: ZB-H1's are a third of a 1F1B
backward slot), the stage inputs it keeps (``kept_inputs``) and, with ``--rounds`` > 0, the
median time of a step over that many rounds of ``--steps`` steps, the rows interleaved
(round r runs every row once, in turn), and its ratio to 1F1B's.
"""

from __future__ import annotations

import argparse
import os
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import dp, parallel  # noqa: E402

STAGES, LAYERS, WIDTH = 4, 8, 128


def block(h, w):
    return h + jnp.tanh(h @ w["a"]) @ w["b"], None


def stage(blocks, h):
    return jax.lax.scan(block, h, blocks)[0]


def head(params, h, y):
    return jnp.mean((h @ params["out"] - y) ** 2)


def losses(micro: int) -> dict:
    def autodiff(params, batch, rng):
        h = batch["x"] @ params["inp"]
        h = parallel.pipeline_apply(
            stage, params["blocks"], h, stage_axis="pipe", num_microbatches=micro
        )
        return head(params, h, batch["y"]), {}

    def scheduled(schedule):
        def loss(params, batch, rng):
            blocks = params["blocks"]
            if isinstance(schedule, parallel.Interleaved):  # this stage's chunks, stacked
                v = schedule.virtual
                blocks = jax.tree.map(lambda t: t.reshape((v, -1) + t.shape[1:]), blocks)
            h = batch["x"] @ params["inp"]
            value = parallel.pipeline_loss(
                stage,
                head,
                blocks,
                {"out": params["out"]},
                h,
                batch["y"],
                stage_axis="pipe",
                schedule=schedule,
            )
            return value, {}

        return loss

    return {
        "pipeline_apply (autodiff GPipe)": (autodiff, parallel.GPipe(micro)),
        **{
            f"pipeline_loss({s!r})": (scheduled(s), s)
            for s in (
                parallel.GPipe(micro),
                parallel.OneFOneB(micro),
                parallel.Interleaved(micro, virtual=2),
                parallel.ZeroBubble(micro),
            )
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024, help="examples per replica a step")
    parser.add_argument("--micro", type=int, default=16, help="micro-batches a step")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (0: none)")
    parser.add_argument("--steps", type=int, default=5, help="steps a round")
    a = parser.parse_args()
    rng = np.random.default_rng(0)
    params = {
        "inp": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) * 0.05,
        "blocks": {
            "a": rng.normal(size=(LAYERS, WIDTH, 4 * WIDTH)).astype(np.float32) * 0.05,
            "b": rng.normal(size=(LAYERS, 4 * WIDTH, WIDTH)).astype(np.float32) * 0.05,
        },
        "out": rng.normal(size=(WIDTH, 4)).astype(np.float32) * 0.05,
    }
    specs = {"inp": P(), "blocks": {"a": P("pipe"), "b": P("pipe")}, "out": P()}
    batch = {
        "x": np.ones((2 * a.rows, WIDTH), np.float32),
        "y": np.ones((2 * a.rows, 4), np.float32),
    }
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, STAGES), ("data", "pipe"))
    print(
        f"data 2 x pipe {STAGES}, {LAYERS} layers of width {WIDTH} (4x hidden), {a.rows} rows "
        f"a replica in {a.micro} micro-batches\n"
    )
    rows = {}
    for name, (loss, schedule) in losses(a.micro).items():
        trainer = dp.Trainer(
            loss, optax.sgd(0.1), mesh=mesh, axis_name="data", layout=dp.Layout(pipeline="pipe")
        )
        state = trainer.init(params, jax.random.key(0), specs=specs)
        step, args = trainer.step_program(state, batch)
        m = step.lower(*args).compile().memory_analysis()
        autodiff = name.startswith("pipeline_apply")
        kept = f"{a.micro} and their activations" if autodiff else schedule.kept_inputs(STAGES)
        rows[name] = {
            "trainer": trainer,
            "state": state,
            "batch": trainer.shard_batch(batch),
            "cells": f"| `{name}` | {m.temp_size_in_bytes / 2**20:.2f} | "
            f"{m.argument_size_in_bytes / 2**20:.2f} | {schedule.bubble_fraction(STAGES):.3f} | "
            f"{kept} |",
            "times": [],
        }
    for _ in range(a.rounds):  # interleaved: every row once a round
        for row in rows.values():
            state, metrics = row["trainer"].step(row["state"], row["batch"])  # warm
            jax.block_until_ready(metrics)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                state, metrics = row["trainer"].step(state, row["batch"])
            jax.block_until_ready(metrics)
            row["times"].append((time.perf_counter() - t0) / a.steps)
            row["state"] = state
    timed = a.rounds > 0
    base = next(r for n, r in rows.items() if "OneFOneB" in n)
    print(
        "| step's loss | temp MiB | argument MiB | bubble | kept inputs |"
        + (" step ms | / 1F1B |" if timed else "")
    )
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if timed else ""))
    for row in rows.values():
        line = row["cells"]
        if timed:
            ms = 1e3 * float(np.median(row["times"]))
            ratio = float(np.median(row["times"])) / float(np.median(base["times"]))
            line += f" {ms:.1f} | {ratio:.2f} |"
        print(line)
    if timed:
        print(f"\n{a.rounds} rounds of {a.steps} steps per row, interleaved; medians")


if __name__ == "__main__":
    main()
