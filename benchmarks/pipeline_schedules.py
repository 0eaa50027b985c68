"""Pipeline schedules inside a dp.Trainer step: compiled memory, bubble and step time.

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_schedules.py          # ~2 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_schedules.py --rows 8192 --rounds 0

The model: an input projection, 8 residual MLP layers (width 128, 4x hidden) stacked and split
into 4 stages over a ``pipe`` axis, an output projection and a squared error; 8 simulated
devices as data 2 x pipe 4; ``--rows`` examples per data replica per step (1024), split into
``--micro`` micro-batches (16). Rows, one Trainer step each (``Trainer.step_program``, compiled,
nothing run):

* ``GPipe by autodiff``: GPipe's forward (every stage given the last one's output)
  differentiated by jax, the baseline a user without a schedule's own backward would write:
  every micro-batch's activations inside every stage are kept;
* ``pipeline_loss(GPipe(M))``, ``pipeline_loss(OneFOneB(M))``,
  ``pipeline_loss(Interleaved(M, virtual=2))``, ``pipeline_loss(ZeroBubble(M))``: the
  schedule's own backward behind a ``jax.custom_vjp`` (stage inputs kept, each stage's
  forward recomputed in its backward).

Columns: the compiled step's temp and argument bytes per device (``memory_analysis()``), the
schedule's bubble (``bubble_fraction``, in its own slots: ZB-H1's are a third of a 1F1B
backward slot), the stage inputs it keeps (``kept_inputs``) and, with ``--rounds`` > 0, the
median time of a step over that many rounds of ``--steps`` steps, the rows interleaved
(round r runs every row once, in turn), and its ratio to 1F1B's.

Then 1F1B and ZB-H1 side by side, per stage and step: the slots of each kind its table runs
(1F1B's lowering: 2(M + S - 1) lock-step slots, a forward or a backward, B and W at once;
ZB-H1's ``table``), the idle share in units of one forward (a B, a W each one unit, 1F1B's
backward two), the FLOPs a device executes (each operation compiled alone on one
micro-batch, ``cost_analysis()``, times its count: the whole step's ``cost_analysis()``
counts a loop's body once), the whole program's ``cost_analysis()`` FLOPs as reported, the
step time measured here and a model of it on devices of their own: every slot of the table
takes its slowest stage's operation's time (each operation timed alone on one device).
On simulated CPU devices all 8 share the host's cores, so an idle slot frees a core for
another device instead of costing time: the measured step is the total work plus the
lowering's overhead, and the bubble shows in the model alone.
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

from jaxcoll import dp, parallel, primitives  # noqa: E402
from jaxcoll.parallel._backward_split import _Split  # noqa: E402
from jaxcoll.parallel._stages import _forward  # noqa: E402

STAGES, LAYERS, WIDTH = 4, 8, 128


def block(h, w):
    return h + jnp.tanh(h @ w["a"]) @ w["b"], None


def stage(blocks, h):
    return jax.lax.scan(block, h, blocks)[0]


def head(params, h, y):
    return jnp.mean((h @ params["out"] - y) ** 2)


def one_f_one_b_table(m: int, stages: int) -> list[list]:
    """1F1B's lock-step slots as ``_lockstep`` lowers them: slot t, stage s runs the forward
    of micro-batch (t - s) / 2 when t - s is even, the backward (B and W at once) of
    (t - 2S + 1 + s) / 2 when it is odd; None: idle."""
    rows = []
    for s in range(stages):
        row = []
        for t in range(2 * (m + stages - 1)):
            i, j = (t - s) // 2, (t - 2 * stages + 1 + s) // 2
            forward = (t - s) % 2 == 0
            row.append(("F", i) if forward and 0 <= i < m else None)
            if not forward and 0 <= j < m:
                row[-1] = ("BW", j)
        rows.append(row)
    return rows


def _timed(f, *args, n: int = 20) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def op_costs(params: dict, rows: int) -> dict[str, tuple[float, float]]:
    """Each operation of a slot on one micro-batch of ``rows`` examples and stage 0's
    layers, compiled alone on one device: ``{op: (FLOPs, seconds)}``. F: the forward; BW:
    1F1B's backward (the forward recomputed, then the input's and the params' gradients);
    B and W: ZB-H1's halves of it (B recomputes the forward)."""
    per = LAYERS // STAGES
    own = jax.tree.map(lambda t: jnp.asarray(t[:per]), params["blocks"])
    h = jnp.ones((rows, WIDTH), jnp.float32)

    def unrolled(blocks, h):  # the same stage, its layers' loop unrolled (FLOPs counted once)
        return jax.lax.scan(block, h, blocks, unroll=True)[0]

    out = {}
    for counted, fn in ((True, unrolled), (False, stage)):
        split = _Split(fn, own, h)
        bufs = [jnp.zeros((1, *shape), dtype) for shape, dtype, _ in split.saved_types()]
        ops = {
            "F": (jax.jit(fn), (own, h)),
            "BW": (jax.jit(lambda o, x, c, fn=fn: jax.vjp(fn, o, x)[1](c)), (own, h, h)),
            "B": (
                jax.jit(lambda o, x, c, b, sp=split: sp.run_b(o, x, c, into=(b, 0))),
                (own, h, h, bufs),
            ),
            "W": (jax.jit(lambda b, sp=split: sp.run_w(b, 0)), (bufs,)),
        }
        for name, (f, args) in ops.items():
            if counted:
                cost = f.lower(*args).compile().cost_analysis()
                out[name] = (float((cost[0] if isinstance(cost, list) else cost)["flops"]),)
            else:
                out[name] += (_timed(f, *args),)
    return out


def compare(rows: dict, params: dict, a: argparse.Namespace) -> None:
    """1F1B and ZB-H1 side by side (see the module's docstring)."""
    costs = op_costs(params, a.rows // a.micro)
    units = {"F": 1, "B": 1, "W": 1, "BW": 2}
    tables = {
        "1F1B": one_f_one_b_table(a.micro, STAGES),
        "ZB-H1": parallel.ZeroBubble(a.micro).table(STAGES),
    }
    names = {"1F1B": "OneFOneB", "ZB-H1": "ZeroBubble"}
    timed = a.rounds > 0
    base = next(r for n, r in rows.items() if "OneFOneB" in n)
    print(
        "\n| schedule | slots | idle units / stage | GFLOP / device (executed) | "
        "HLO GFLOP (cost_analysis) | model ms (own devices) |"
        + (" step ms | / 1F1B |" if timed else "")
    )
    print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if timed else ""))
    for label, table in tables.items():
        ticks = list(zip(*table))
        step_units = sum(max((units[op[0]] for op in tick if op), default=0) for tick in ticks)
        busy = max(sum(units[op[0]] for op in row if op) for row in table)
        flops = max(sum(costs[op[0]][0] for op in row if op) for row in table)
        model = sum(max((costs[op[0]][1] for op in tick if op), default=0.0) for tick in ticks)
        row = next(r for n, r in rows.items() if names[label] in n)
        line = (
            f"| {label} | {len(ticks)} | {step_units - busy} (of {step_units}) | "
            f"{flops / 1e9:.2f} | {row['hlo_flops'] / 1e9:.2f} | {1e3 * model:.1f} |"
        )
        if timed:
            med = float(np.median(row["times"]))
            line += f" {1e3 * med:.1f} | {med / float(np.median(base['times'])):.2f} |"
        print(line)
    print(
        "\none micro-batch of one stage alone on one device: "
        + ", ".join(f"{k} {v[0] / 1e6:.0f} MFLOP {1e3 * v[1]:.2f} ms" for k, v in costs.items())
        + ". The model leaves out the head (last stage) and the transfers."
    )


def autodiff_gpipe(blocks, h, micro: int):
    """GPipe's forward over the ``pipe`` axis (stage s runs micro-batch t - s at step t, one
    ``sendrecv`` a step), then every stage given the last one's outputs: for jax to
    differentiate, which keeps every step's residuals."""
    xs = h.reshape((micro, -1) + h.shape[1:])
    _, outs = _forward("autodiff GPipe", stage, blocks, xs, "pipe")
    return primitives.broadcast(outs.reshape(h.shape), "pipe", STAGES - 1)


def losses(micro: int) -> dict:
    def autodiff(params, batch, rng):
        h = autodiff_gpipe(params["blocks"], batch["x"] @ params["inp"], micro)
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
                axis_name="pipe",
                schedule=schedule,
            )
            return value, {}

        return loss

    return {
        "GPipe by autodiff": (autodiff, parallel.GPipe(micro)),
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
    parser.add_argument(
        "--only", default="", help="comma-separated substrings of the rows to run (all: empty)"
    )
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
        if a.only and not any(part in name for part in a.only.split(",")):
            continue
        layout = dp.Layout(replicate="data", pipeline="pipe")
        trainer = dp.Trainer(loss, optax.sgd(0.1), mesh=mesh, layout=layout)
        state = trainer.init(params, jax.random.key(0), specs=specs)
        step, args = trainer.step_program(state, batch)
        compiled = step.lower(*args).compile()
        m = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        autodiff = name.startswith("GPipe by autodiff")
        kept = f"{a.micro} and their activations" if autodiff else schedule.kept_inputs(STAGES)
        rows[name] = {
            "trainer": trainer,
            "state": state,
            "batch": trainer.shard_batch(batch),
            "cells": f"| `{name}` | {m.temp_size_in_bytes / 2**20:.2f} | "
            f"{m.argument_size_in_bytes / 2**20:.2f} | {schedule.bubble_fraction(STAGES):.3f} | "
            f"{kept} |",
            "times": [],
            "hlo_flops": float((cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)),
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
    if any("OneFOneB" in n for n in rows) and any("ZeroBubble" in n for n in rows):
        compare(rows, params, a)


if __name__ == "__main__":
    main()
