"""Data-parallel step time: one device vs a hand-written shard_map step vs dp.Trainer vs torch DDP.

    .venv/bin/python benchmarks/dp_step.py                 # ~3-5 minutes on 2 CPU cores
    .venv/bin/python benchmarks/dp_step.py --steps 10 --no-torch   # quicker, JAX rows only
    .venv/bin/python benchmarks/dp_step.py --steps 40 --no-torch   # chunks of 8 for (e), (f)

MLP 784-1024-1024-10, global batch 512, Adam, float32. Medians of per-step wall times
(each step waited for) after warm-up, all rows in one run. The JAX rows are interleaved: every
row is compiled and warmed up first, then each of ``--rounds`` rounds times a share of every
row's steps in turn, so that load from other processes on a shared machine hits all rows
alike instead of whichever row happened to run at the time:

(a) one device, whole batch, plain jit + optax;
(b) 8 simulated devices, hand-written shard_map step: params made varying, grad, pmean, optax
    (what a careful JAX user writes);
(b0), (b1) the same without the gradient all-reduce, and also without the optimizer update
    (wrong on purpose: they attribute the step time to sync, update and forward/backward);
(c) dp.Trainer.step on 8 devices: default (25 MiB buckets), bucketing off, bf16 gradients,
    ZeRO-1;
(e) dp.Trainer.fit on host batches (a dp.Batches over 4096 in-memory examples: each step
    gathers its 512 rows and places them on the devices), one step at a time
    (``prefetch=False``: dispatch, wait, then build the next batch), and (f) with prefetch
    (the default: batch s+1 is built and placed while step s runs, at most two steps in
    flight). Their step time is a chunk's wall time over its steps (fit does not expose a
    per-step time), so they include the batch building that (a)-(c) leave out;
(d) torch DDP, gloo on CPU, world sizes 2 and 8, the same global batch (512 / W per rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEVICES = 8
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=20, help="measured steps per row")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the rows")
parser.add_argument("--no-torch", action="store_true")
parser.add_argument("--devices", type=int, default=DEVICES)
args = parser.parse_args()
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import dp  # noqa: E402

SIZES = (784, 1024, 1024, 10)
BATCH = 512
LR = 1e-3


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        f"l{i}": {
            "w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "b": np.zeros(b, np.float32),
        }
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True))
    }


def forward(params, x):
    for i in range(len(SIZES) - 1):
        x = x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
        if i < len(SIZES) - 2:
            x = jax.nn.relu(x)
    return x


def loss_fn(params, batch, rng=None):
    logits = forward(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def timed(step, state, batch):
    """(compile+first step seconds, run): ``run(k)`` times k more steps, each waited for."""
    t = time.perf_counter()
    state = jax.block_until_ready(step(state, batch))
    first = time.perf_counter() - t
    for _ in range(args.warmup):
        state = jax.block_until_ready(step(state, batch))
    held = [state]

    def run(k: int) -> list[float]:
        times = []
        for _ in range(k):
            t = time.perf_counter()
            held[0] = jax.block_until_ready(step(held[0], batch))
            times.append(time.perf_counter() - t)
        return times

    return first, run


def interleaved(runs: list) -> list[float]:
    """Median step ms of every row, its steps timed in ``args.rounds`` interleaved rounds."""
    rounds = max(1, min(args.rounds, args.steps))
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        k = args.steps // rounds + (r < args.steps % rounds)
        for i, run in enumerate(runs):
            times[i].extend(run(k))
    return [1e3 * statistics.median(t) for t in times]


def row_single(batch):
    opt = optax.adam(LR)
    dev = jax.devices()[0]
    params = jax.device_put(init_params(), dev)
    state = (params, opt.init(params))

    def step(state, batch):
        params, opt_state = state
        g = jax.grad(lambda p: loss_fn(p, batch)[0])(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step, donate_argnums=0)
    return timed(step, state, jax.device_put(batch, dev))


def row_handwritten(batch, mode="pmean"):
    """mode: "pmean" (the real step), "nosync" (no gradient all-reduce), "gradonly" (no
    all-reduce and no optimizer: forward + backward only). The last two are wrong on purpose,
    to attribute the step time; they return device 0's params (check_vma=False)."""
    opt = optax.adam(LR)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep = NamedSharding(mesh, P())
    params = jax.device_put(init_params(), rep)
    state = (params, jax.device_put(opt.init(params), rep))

    def body(state, batch):
        params, opt_state = state
        if mode == "pmean":
            pv = jax.tree.map(lambda w: lax.pcast(w, "data", to="varying"), params)
        else:
            pv = params
        g = jax.grad(lambda p: loss_fn(p, batch)[0])(pv)
        if mode == "gradonly":
            return jax.tree.map(lambda w, d: w - 1e-30 * d, params, g), opt_state
        if mode == "pmean":
            g = lax.pmean(g, "data")
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=(P(), P()),
            check_vma=mode == "pmean",
        ),
        donate_argnums=0,
    )
    return timed(step, state, jax.device_put(batch, NamedSharding(mesh, P("data"))))


def row_trainer(batch, sync):
    trainer = dp.Trainer(loss_fn, optax.adam(LR), sync=sync)
    state = trainer.init(init_params(), jax.random.key(0))
    placed = trainer.shard_batch(batch)

    def step(state, b):
        return trainer.step(state, b)[0]

    return timed(step, state, placed)


def row_fit(prefetch: bool):
    """fit over host batches; ``run(k)`` times one fit call of k steps (k equal entries)."""
    rng = np.random.default_rng(1)
    arrays = {
        "x": rng.normal(size=(8 * BATCH, SIZES[0])).astype(np.float32),
        "y": rng.integers(0, SIZES[-1], 8 * BATCH).astype(np.int32),
    }
    data = dp.Batches(arrays, BATCH)
    trainer = dp.Trainer(loss_fn, optax.adam(LR))
    held = [trainer.init(init_params(), jax.random.key(0))]

    def fit(k: int) -> float:
        t = time.perf_counter()
        target = int(jax.device_get(held[0].step)) + k
        held[0], _ = trainer.fit(held[0], data, steps=target, progress=False, prefetch=prefetch)
        jax.block_until_ready(held[0])
        return time.perf_counter() - t

    first = fit(1)
    fit(args.warmup)

    def run(k: int) -> list[float]:
        return [fit(k) / k] * k

    return first, run


def torch_ddp(world: int, batch, q) -> None:
    """Spawned ranks: DDP over gloo, medians from rank 0 put on ``q``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ret = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_torch_rank, args=(r, world, batch, ret, args.steps, args.warmup))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    result = ret.get()
    for p in procs:
        p.join()
    q.append(result)


def _torch_rank(rank, world, batch, ret, steps, warmup):
    import torch
    import torch.distributed as tdist
    from torch import nn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    per = BATCH // world
    x = torch.from_numpy(batch["x"][rank * per : (rank + 1) * per])
    y = torch.from_numpy(batch["y"][rank * per : (rank + 1) * per]).long()
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # DDP all-reduces the bucketed gradients during backward
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    # the slowest rank sets the step time
    med = torch.tensor([statistics.median(times)])
    tdist.all_reduce(med, op=tdist.ReduceOp.MAX)
    if rank == 0:
        ret.put(1e3 * float(med))
    tdist.destroy_process_group()


def main() -> int:
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(BATCH, SIZES[0])).astype(np.float32),
        "y": rng.integers(0, SIZES[-1], BATCH).astype(np.int32),
    }
    n = jax.device_count()
    print(
        f"MLP {'-'.join(map(str, SIZES))}, global batch {BATCH}, Adam, float32; "
        f"{n} simulated devices on {os.cpu_count()} CPU cores; jax {jax.__version__}; "
        f"median of {args.steps} steps after {args.warmup} warm-up, in {args.rounds} "
        f"interleaved rounds"
    )
    pending: list[tuple[str, float, object]] = []
    pending.append(("(a) 1 device, jit + optax", *row_single(batch)))
    pending.append((f"(b) {n} dev, shard_map + pmean (hand-written)", *row_handwritten(batch)))
    pending.append((f"(b0) {n} dev, (b) minus the all-reduce", *row_handwritten(batch, "nosync")))
    pending.append((f"(b1) {n} dev, (b0) minus the optimizer", *row_handwritten(batch, "gradonly")))
    for name, sync in [
        ("default (25 MiB buckets)", dp.sync.DDP()),
        ("bucketing off", dp.sync.DDP(bucket_mb=None)),
        ("bf16 gradients", dp.sync.DDP(hook=dp.hooks.Compress(jnp.bfloat16))),
        ("ZeRO-1", dp.sync.ZeRO1()),
    ]:
        pending.append((f"(c) {n} dev, dp.Trainer, {name}", *row_trainer(batch, sync=sync)))
    pending.append((f"(e) {n} dev, Trainer.fit, host batches, serial", *row_fit(False)))
    pending.append((f"(f) {n} dev, Trainer.fit, host batches, prefetch", *row_fit(True)))
    medians = interleaved([run for _, _, run in pending])
    rows: list[tuple[str, float, float | None]] = [
        (name, ms, first) for (name, first, _), ms in zip(pending, medians, strict=True)
    ]
    torch_rows = {}
    if not args.no_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed (pip install torch==2.13.0): skipping (d)")
        else:
            for world in (2, 8):
                out: list[float] = []
                torch_ddp(world, batch, out)
                torch_rows[world] = out[0]
                rows.append((f"(d) torch DDP gloo, W={world}", out[0], None))
    a = rows[0][1]
    b = rows[1][1]
    c = rows[4][1]
    print(f"\n| {'row':48s} | step ms | vs (a) | vs (b) | compile+1st s |")
    print(f"|{'-' * 50}|--------:|-------:|-------:|--------------:|")
    for name, ms, first in rows:
        fs = f"{first:.2f}" if first is not None else "-"
        print(f"| {name:48s} | {ms:7.1f} | {ms / a:5.2f}x | {ms / b:5.2f}x | {fs:>13s} |")
    e, f = rows[8][1], rows[9][1]
    print(
        f"\n(c)/(b) = {c / b:.2f} (goal <= 1.05); (c)/(a) = {c / a:.2f}; "
        f"(f)/(e) = {f / e:.2f} (fit: prefetch vs one step at a time)"
    )
    if n in torch_rows:
        print(f"(c)/(torch DDP W={n}) = {c / torch_rows[n]:.2f} (goal <= 0.4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
