"""The cost of a checkpoint to the steps around it: asynchronous saves vs steady steps.

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_save.py              # ~2 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_save.py --rounds 2 --no-procs2  # quick

The model is examples/gpt.py's default (``--layout dp8``: 4 blocks of width 64, context 32,
global batch 32 in 2 accumulation steps, AdamW; 0.2 M params, a 2.6 MB TrainState), trained by
``Trainer.fit`` on random tokens with ``checkpoint=dp.Checkpointer(dir, every=EVERY)``. A
callback takes the time at which each step is reported; a step's time is the time since the
one before. ``fit`` saves after step k (the state is complete: the save's blocking part,
the copy to host memory, lands in step k+1's time) and waits for that save's commit when it
dispatches step k+2 (landing in step k+1's time too, or k+2's). Rows:

* ``steady``: the median time of the steps at least 3 steps from a save;
* ``k+1``, ``k+2``: the median time of the first and second step after a save;
* ``around``: the median of the mean of the two (what a save costs those steps, per step);
* ``per save``: the median of (k+1) + (k+2) - 2 x steady, in ms.

for ``async`` (the default: ``enable_async_checkpointing=True``) and ``sync``
(``enable_async_checkpointing=False``: the save returns once committed), run interleaved
(rounds alternate the two), in one process on 8 simulated devices and, unless
``--no-procs2``, in 2 processes x 4 devices (``jaxcoll-run``; process 0 reports).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVERY, WARMUP = 40, 8, 4


def _gpt():
    """examples/gpt.py as a module (it sets 8 simulated devices in a plain run)."""
    spec = importlib.util.spec_from_file_location("gpt", os.path.join(ROOT, "examples", "gpt.py"))
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    return gpt


class Clock:
    """The time each step is reported at (``on_step`` is fit's callback)."""

    def __init__(self) -> None:
        self.stamps: dict[int, float] = {}

    def on_step(self, step: int, metrics: dict) -> None:
        self.stamps[step] = time.perf_counter()


def measure(
    rounds: int, steps: int, every: int, scratch: str, batch: int
) -> dict[str, list[dict[str, float]]]:
    """Step times of ``rounds`` runs per mode, the modes interleaved; checkpoints under
    ``scratch`` (the same folder for every process); ``batch`` sequences a step."""
    gpt = _gpt()
    gpt.BATCH = batch
    import jax
    import numpy as np

    from jaxcoll import dp

    trainer = gpt.trainer_for("dp8")
    params = gpt.init_params()
    rng = np.random.default_rng(0)
    vocab = len(gpt.VOCAB)
    batches = [
        {
            "x": rng.integers(0, vocab, (gpt.BATCH, gpt.BLOCK)).astype(np.int32),
            "y": rng.integers(0, vocab, (gpt.BATCH, gpt.BLOCK)).astype(np.int32),
        }
        for _ in range(steps)
    ]
    leaves = jax.tree_util.tree_leaves(trainer.init(params, jax.random.key(0)))
    nbytes = sum(x.nbytes for x in leaves)
    trainer.fit(trainer.init(params, jax.random.key(0)), batches, steps=WARMUP, progress=False)
    out: dict[str, list[dict[str, float]]] = {"async": [], "sync": []}
    for r in range(rounds):
        for mode in ("async", "sync") if r % 2 == 0 else ("sync", "async"):
            clock = Clock()
            directory = os.path.join(scratch, f"{mode}{r}")
            ckpt = dp.Checkpointer(
                directory, every=every, enable_async_checkpointing=mode == "async"
            )
            trainer.fit(
                trainer.init(params, jax.random.key(0)),
                batches,
                steps=steps,
                checkpoint=ckpt,
                callbacks=[clock.on_step],
                progress=False,
            )
            stamps = clock.stamps
            times = {s: stamps[s] - stamps[s - 1] for s in stamps if s - 1 in stamps}
            saves = [s for s in range(every, steps, every)]
            near = {s + d for s in saves for d in (-2, -1, 0, 1, 2)}
            steady = [t for s, t in times.items() if s not in near and s > 2]
            k1 = [times[s + 1] for s in saves if s + 1 in times]
            k2 = [times[s + 2] for s in saves if s + 2 in times]
            out[mode].append(
                {
                    "steady": float(np.median(steady)),
                    "k1": float(np.median(k1)),
                    "k2": float(np.median(k2)),
                    "around": float(np.median([(a + b) / 2 for a, b in zip(k1, k2)])),
                    "per_save": float(np.median([a + b for a, b in zip(k1, k2)]))
                    - 2 * float(np.median(steady)),
                    "state_mb": nbytes / 1e6,
                }
            )
            if jax.process_index() == 0:
                shutil.rmtree(directory, ignore_errors=True)
    return out


def table(title: str, results: dict[str, list[dict[str, float]]]) -> str:
    import numpy as np

    lines = [
        f"{title}",
        "| mode  | steady ms | k+1 ms | k+2 ms | around ms | around / steady | per save ms |",
        "|-------|----------:|-------:|-------:|----------:|----------------:|------------:|",
    ]
    for mode, rows in results.items():
        m = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
        lines.append(
            f"| {mode:5} | {1e3 * m['steady']:9.1f} | {1e3 * m['k1']:6.1f} | "
            f"{1e3 * m['k2']:6.1f} | {1e3 * m['around']:9.1f} | "
            f"{m['around'] / m['steady']:14.2f}x | {1e3 * m['per_save']:11.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="runs per mode (interleaved)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per run")
    parser.add_argument("--every", type=int, default=EVERY, help="steps between saves")
    parser.add_argument(
        "--batch",
        type=int,
        default=32,
        help="sequences a step (the example's 32): the same "
        "model and state, a step that many times longer",
    )
    parser.add_argument("--no-procs2", action="store_true", help="skip the 2-process rows")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a jaxcoll-run process: JSON here
    a = parser.parse_args()
    if a.worker:
        import jaxcoll

        jaxcoll.init()
        import jax

        results = measure(a.rounds, a.steps, a.every, os.path.dirname(a.worker), a.batch)
        if jax.process_index() == 0:
            with open(a.worker, "w") as fh:
                json.dump(results, fh)
        return
    t0 = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="ckpt-bench-")
    results = measure(a.rounds, a.steps, a.every, scratch, a.batch)
    print(table("1 process x 8 simulated devices:", results), flush=True)
    if not a.no_procs2:
        path = os.path.join(scratch, "procs2.json")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.setdefault("JAX_PLATFORMS", "cpu")
        subprocess.run(
            [sys.executable, "-m", "jaxcoll.run", "--nprocs", "2", "--devices-per-proc", "4"]
            + [__file__, "--rounds", str(a.rounds), "--steps", str(a.steps)]
            + ["--every", str(a.every), "--batch", str(a.batch), "--worker", path],
            cwd=ROOT,
            env=env,
            check=True,
        )
        with open(path) as fh:
            print(table("\n2 processes x 4 devices (jaxcoll-run):", json.load(fh)))
    shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"\n{a.rounds} rounds of {a.steps} steps of {a.batch} sequences, a save every "
        f"{a.every}; "
        f"{time.monotonic() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
