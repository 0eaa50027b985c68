"""DiLoCo against synchronous training on the GPT example: validation loss, bytes across
replicas and step time.

    .venv/bin/python benchmarks/diloco.py                       # 4 runs of 300 steps, ~6 min
    .venv/bin/python benchmarks/diloco.py --steps 100 --runs sync*3,diloco8

examples/gpt.py's default model and recipe (4 blocks of width 64, 32 sequences of 32
characters a step, AdamW with warmup and cosine decay, 2 accumulated micro-batches) on
``--layout`` (default ``dp2xfsdp4``: 2 data replicas of 4 devices, 8 simulated CPU devices),
the same seed, params and batches for every run, each run one after another in this process:

* ``sync``: the layout's own strategy (``dp2xfsdp4``: HSDP, FSDP within each replica and the
  gradients all-reduced across the replicas every step);
* ``diloco8``: the example's ``--sync diloco8``: ``dp.sync.DiLoCo(inner=FSDP(), every=8,
  warmup=50)``: 50 synchronous steps, then the replicas meet every 8 steps, the outer step
  Nesterov with lr 0.8 and momentum 0.3, the inner AdamW at three times the synchronous rates
  (the example's ``SEMISYNC_WARMUP`` and ``SEMISYNC_LR_SCALE``); ``diloco8:int8`` the same with
  the pseudo-gradients sent in 8 bits; ``localsgd8`` the replicas' average;
* a suffix ``@lr/momentum`` sets DiLoCo's outer step (``diloco8@0.7/0.9``: the paper's),
  ``+n`` the synchronous steps first (``diloco8+0``: none), and ``*k`` the inner rates'
  factor (``sync*3``: synchronous training at three times the rates).

Printed per run: the validation loss (the example's 4 validation batches) after ``--steps``
steps (DiLoCo's: of the global params, those of the replicas' last meeting; step 298 at 300
steps, 50 synchronous and every=8), its ratio to the first run's, the bytes each device sends
across replicas per step after the synchronous steps and their mean over the run (read from
the compiled programs: an all-reduce of b bytes over n devices sends ``2 (n - 1) / n * b``, an
all-gather or all-to-all of b ``(n - 1) / n * b``; DiLoCo's is the mean over its ``every``
programs; a collective in a loop counted as often as the loop runs) and the median step time
(the step waited for; steps 10 on).

Measured (jax/jaxlib 0.10.2, 8 simulated CPU devices on 2 shared cores; 201k params;
``--runs sync*3,diloco8,diloco8:int8,sync,localsgd8,diloco8+0``)::

    | run          | val loss @300 | / sync*3 | across replicas / step | run's mean | ms / step |
    | sync*3       | 0.4402        | 1.000    | 402.4 kB               | 402.4 kB   | 89        |
    | diloco8      | 0.4463        | 1.014    | 25.2 kB                | 88.0 kB    | 84        |
    | diloco8:int8 | 0.4454        | 1.012    | 6.5 kB                 | 72.5 kB    | 76        |
    | sync         | 0.4767        | 1.083    | 402.4 kB               | 402.4 kB   | 88        |
    | localsgd8    | 0.4458        | 1.013    | 25.2 kB                | 88.0 kB    | 86        |
    | diloco8+0    | 0.4616        | 1.049    | 25.2 kB                | 25.2 kB    | 93        |

HSDP sends each micro-batch's gradients across the replicas (2 a step, 201 kB each: its
shard of the params in float32, all-reduced over 2); DiLoCo sends its params' shard once in 8
steps (16x fewer bytes), 3.9x fewer again in 8 bits; a synchronous step of its warm-up sends
the gradients' and the params' shards once each (402 kB). At equal rates (x3, synchronous
training's best of x1 to x4: 0.4767, 0.4450, 0.4402, 0.4411) DiLoCo every 8 steps after 50
synchronous steps ends 1.4% behind synchronous training, and 6.4% below the example's
synchronous recipe (x1). Without the synchronous steps it is 4.9% behind. Other runs of the
same command (``--runs ...``; validation loss at 300):

* synchronous steps first at x2 / x3 / x4: ``diloco8+50`` 0.4540 / 0.4463 / -,
  ``diloco8+100`` 0.4516 / 0.4446 / 0.4470 (``sync`` 0.4450 / 0.4402 / 0.4411);
* none (``+0``), inner rates x1 (the synchronous recipe's): the paper's outer step
  ``diloco8@0.7/0.9+0*1`` 1.1427, ``localsgd8+0*1`` 0.5310 (11% behind ``sync``); x0.5 worse
  again (0.8433, 1.3570);
* none, inner rates x1.5 / x2 / x3 / x4: ``localsgd8`` 0.4866 / 0.4717 / 0.4613 / -,
  ``diloco8`` (0.8/0.3) 0.4823 / 0.4734 / 0.4616 / 0.4688;
* none, outer steps at x2: 0.7/0.5 0.4894, 0.9/0.2 0.4809, 1.0/0.3 0.5280: the outer
  momentum amplifies each interval's progress (``lr / (1 - momentum)``) and overshoots at
  every=8.

Two replicas each taking AdamW steps on half the batch are not one AdamW step on the whole:
averaging their changes cancels part of each one's noise and part of its progress, which the
higher inner rate gives back; their first steps from random params diverge most, which the
synchronous steps avoid. At H = 8 the outer Nesterov step gains little over the plain average
(``localsgd8``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxcoll import dp  # noqa: E402

PATH = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "s8": 1, "u8": 1, "pred": 1}
_WIRE = {"all-reduce": 2.0, "all-gather": 1.0, "all-to-all": 1.0, "reduce-scatter": 1.0}


def load_example():
    spec = importlib.util.spec_from_file_location("gpt_example", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def groups_of(line: str) -> list[list[int]]:
    """The replica groups of one HLO collective (explicit, mesh-axes or iota form; ``{}``:
    every device)."""
    if "replica_groups={}" in line:
        return [list(range(jax.device_count()))]
    explicit = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if explicit:
        return [
            [int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", explicit[1])
        ]
    mesh = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
        r"\{([^}]*)\}",
        line,
    )
    if mesh:  # mesh['a'=2,'b'=4] {'a'}, its devices in order or as device_ids=([4,2]T(1,0))
        dims = re.findall(r"'(\w+)'=(\d+)", mesh[1])
        names, sizes = [d[0] for d in dims], [int(d[1]) for d in dims]
        along = [names.index(a) for a in re.findall(r"'(\w+)'", mesh[4])]
        ids = np.arange(int(np.prod(sizes)))
        if mesh[2]:
            ids = ids.reshape([int(d) for d in mesh[2].split(",")])
            if mesh[3]:
                ids = ids.transpose([int(d) for d in mesh[3].split(",")])
        ids = ids.reshape(sizes)
        ids = ids.transpose([i for i in range(len(sizes)) if i not in along] + along)
        return ids.reshape(-1, int(np.prod([sizes[i] for i in along]))).tolist()
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota is None:
        raise ValueError(f"no replica groups in {line[:200]}")
    dims = [int(d) for d in iota[3].split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota[4]:
        ids = ids.transpose([int(d) for d in iota[4].split(",")])
    return ids.reshape(int(iota[1]), int(iota[2])).tolist()


def executions(hlo: str) -> dict[str, int]:
    """How many times each computation of a compiled HLO module runs per call of its entry:
    a while loop's body its known trip count times its caller's, anything else called
    (fusions, reductions, branches) its caller's."""
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        head = re.match(r"(ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name = head[2]
            entry = name if head[1] else entry
            calls[name] = []
            continue
        if name is None:
            continue
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        for kind, callee in re.findall(
            r"(calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)", line
        ):
            calls[name].append((callee, int(trips[1]) if kind == "body" and trips else 1))
    count: dict[str, int] = {}

    def visit(comp: str, times: int) -> None:
        count[comp] = count.get(comp, 0) + times
        for callee, factor in calls.get(comp, []):
            visit(callee, times * factor)

    visit(entry, 1)
    return count


def cross_replica_bytes(hlo: str, replica_of) -> float:
    """Bytes each device sends over the wire per step in the collectives spanning replicas
    (one in a loop body counted as many times as the loop runs)."""
    total, runs, times = 0.0, executions(hlo), 1
    for line in hlo.splitlines():
        head = re.match(r"(ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            times = runs.get(head[2], 0)
        op = re.search(r"= .* (all-reduce|all-gather|all-to-all|reduce-scatter)\(", line)
        if not op:
            continue
        groups = groups_of(line)
        if not any(len({replica_of(d) for d in g}) > 1 for g in groups):
            continue
        n = len(groups[0])
        result = line.split("=", 1)[1].split(op[1], 1)[0]
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            size = _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
            # a reduce-scatter's result is 1/n of what it reduces
            scale = n if op[1] == "reduce-scatter" else 1
            total += times * _WIRE[op[1]] * (n - 1) / n * size * scale
    return total


def bytes_per_step(trainer, state, batch, phases: int, start: int = 0) -> float:
    """The mean over ``phases`` consecutive steps' programs of the cross-replica bytes."""
    mesh = trainer.mesh
    first = list(mesh.axis_names).index(trainer.layout.data_axes[0])  # the replicas' axis
    replica_of = {d.id: idx[first] for idx, d in np.ndenumerate(mesh.devices)}.get
    total = 0.0
    for step in range(start, start + phases):
        fn, args = trainer.step_program(state, batch, step=step)
        total += cross_replica_bytes(fn.lower(*args).compile().as_text(), replica_of)
    return total / phases


def parse(gpt, name: str) -> tuple[str, tuple[float, float] | None, float, int | None]:
    """A run's name: ``sync`` or an example's ``--sync`` name, then optionally ``@lr/momentum``
    (DiLoCo's outer Nesterov step), ``+steps`` (the synchronous steps first; default the
    example's ``SEMISYNC_WARMUP``) and ``*scale`` (the inner rates' factor; default 1 for
    ``sync``, the example's ``SEMISYNC_LR_SCALE`` for the others)."""
    name, _, scale = name.partition("*")
    name, _, warm = name.partition("+")
    name, _, outer = name.partition("@")
    default = 1.0 if name == "sync" else gpt.SEMISYNC_LR_SCALE
    pair = None
    if outer:
        lr, momentum = outer.split("/")
        pair = (float(lr), float(momentum))
    return name, pair, float(scale) if scale else default, int(warm) if warm else None


def strategy(gpt, name: str, shard: bool, outer: tuple[float, float] | None, warm: int | None):
    """The run's strategy: None for ``sync``, else the example's (:func:`gpt.semisync`), its
    outer step Nesterov at ``outer`` = (lr, momentum) and its warm-up ``warm`` where given."""
    if name == "sync":
        return None
    sync = gpt.semisync(name, shard)
    changes: dict = {} if warm is None else {"warmup": warm}
    if outer is not None and not isinstance(sync, dp.sync.LocalSGD):
        changes["outer"] = optax.sgd(outer[0], momentum=outer[1], nesterov=True)
    return dataclasses.replace(sync, **changes)


def run(gpt, layout: str, spec: str, steps: int) -> dict:
    name, outer, scale, warm = parse(gpt, spec)
    sync = strategy(gpt, name, bool(gpt.layout(layout).shard), outer, warm)
    trainer = dp.Trainer(
        gpt.loss_fn,
        gpt.optimizer(scale),
        layout=gpt.layout(layout),
        sync=sync,
        accum_steps=gpt.ACCUM,
    )
    state = trainer.init(gpt.init_params(), jax.random.key(0))
    train = gpt.data("train", seed=1, sharding=trainer.batch_sharding)
    val = list(gpt.batches("val", gpt.EVAL_BATCHES, seed=2))
    phases, warm = getattr(sync, "every", 1), getattr(sync, "warmup", 0)
    sent = bytes_per_step(trainer, state, train[0], phases, warm)
    warm_sent = bytes_per_step(trainer, state, train[0], 1) if warm else 0.0
    mean = (min(warm, steps) * warm_sent + max(steps - warm, 0) * sent) / max(steps, 1)
    times = []
    for s in range(steps):
        batch = train[s]
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    loss = float(trainer.evaluate(state, val)["loss"])
    ms = 1e3 * float(np.median(times[10:] or times))
    return {"loss": loss, "bytes": sent, "mean": mean, "ms": ms}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", default="dp2xfsdp4")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", default="sync*3,diloco8,diloco8:int8,sync")
    args = parser.parse_args(argv)
    gpt = load_example()
    names = args.runs.split(",")
    print(f"examples/gpt.py default model, --layout {args.layout}, {args.steps} steps")
    rows = {}
    for name in names:
        rows[name] = run(gpt, args.layout, name, args.steps)
        print(f"  {name}: {rows[name]}", flush=True)
    base = rows[names[0]]
    print(
        f"| run | val loss @{args.steps} | / {names[0]} | bytes across replicas / step "
        f"| the run's mean | ms / step |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['loss']:.4f} | {r['loss'] / base['loss']:.3f} | "
            f"{r['bytes'] / 1e3:.1f} kB | {r['mean'] / 1e3:.1f} kB | {r['ms']:.0f} |"
        )


if __name__ == "__main__":
    main()
