"""dp.Survivor losing a data replica: one process SIGKILLs itself, the others train on.

Usage: ``replica_loss.py OUT KILL_STEP STEPS VICTIM REPLICATE SHARD [MODE]``, every process started
by ``tests/multihost/_launch.start_each`` with ``JAXCOLL_RECOVERABLE=1`` and a finite
``--xla_cpu_collective_timeout_seconds``. HSDP ``dp.Layout(replicate=REPLICATE,
shard=SHARD)``, a width-16 MLP, plain SGD, global batches of 16 rows with an ``id`` column, a
function of the step number (every process can produce every row). Process VICTIM writes
``OUT/killed`` (the time) and SIGKILLs itself instead of running step KILL_STEP. MODE
``rejoin``: ``dp.Survivor(rejoin=True)``, and after the lost step the others wait (at most
60 s) for ``OUT/joined{VICTIM}``; ``replacement``: a process started again with VICTIM's id
writes that file once joined, gets the state with ``survivor.join`` and trains to the end
(its files are ``p{VICTIM}r.*``).

Each process writes ``OUT/p{k}.json`` after every step: ``steps`` (the host step, state.step
after it, the loss, the time it completed), ``seen`` (the ids each of its devices' loss saw,
by step and local rows, from a ``jax.debug.callback`` in the loss), ``recoveries``; and
``OUT/p{k}.npz`` at the end: the initial params (``init/...``), the final params
(``final/...``, NaN where this process holds no shard of them) and every global batch
(``batch/<step>/...``). A process alive whose replica was lost writes ``"orphan"`` (the
error) and ends.
"""

import json
import os
import signal
import sys
import time

import jaxcoll

jaxcoll.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxcoll import dp  # noqa: E402

OUT = sys.argv[1]
KILL_STEP, STEPS, VICTIM, REPLICATE, SHARD = (int(a) for a in sys.argv[2:7])
MODE = sys.argv[7] if len(sys.argv) > 7 else "loss"  # or "rejoin", "replacement"
ME = jax.process_index()
BATCH, WIDTH, IN = 16, 16, 4
LR = 0.1
TAG = "r" if MODE == "replacement" else ""
RECORD = os.path.join(OUT, f"p{ME}{TAG}.json")
if MODE == "replacement":  # joined the job: the survivors may wait for it now
    with open(os.path.join(OUT, f"joined{ME}"), "w") as fh:
        fh.write(repr(time.time()))
events: dict = {"pid": ME, "steps": [], "seen": [], "recoveries": []}


def write() -> None:
    with open(RECORD + ".tmp", "w") as fh:
        json.dump(events, fh)
    os.replace(RECORD + ".tmp", RECORD)


def global_batch(step: int) -> dict:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = np.sin(x.sum(1, keepdims=True)).astype(np.float32)
    ids = (step * BATCH + np.arange(BATCH)).astype(np.int32)
    return {"x": x, "y": y, "id": ids}


def record(step, ids) -> None:
    events["seen"].append([int(step), len(ids), [int(i) for i in np.asarray(ids)]])


def loss_fn(params, batch, rng, *, step):
    jax.debug.callback(record, step, batch["id"])
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - batch["y"]) ** 2), {}


def local(x, fill=0) -> np.ndarray:
    """``x`` from this process's shards, ``fill`` where it holds none (no collective: a peer
    is dead)."""
    full = np.full(x.shape, fill, x.dtype)
    for s in x.addressable_shards:
        full[s.index] = np.asarray(s.data)
    return full


rng = np.random.default_rng(0)
params = {
    "w1": (rng.standard_normal((IN, WIDTH)) / 2).astype(np.float32),
    "b1": np.zeros(WIDTH, np.float32),
    "w2": (rng.standard_normal((WIDTH, 1)) / 4).astype(np.float32),
    "b2": np.zeros(1, np.float32),
}
layout = dp.Layout(replicate=REPLICATE, shard=SHARD)
survivor = dp.Survivor(loss_fn, optax.sgd(LR), layout=layout, rejoin=MODE != "loss")
if MODE == "replacement":  # the job's state, once the survivors take this replica back
    state = survivor.join(params, jax.random.key(0))
    events["joined_at"] = [int(local(state.step)), time.time()]
    events["joined_mesh"] = [d.id for d in survivor.mesh.devices.flat]
    write()
else:
    state = survivor.init(params, jax.random.key(0))
saved = {f"init/{k}": v for k, v in params.items()}
for i in range(int(local(state.step)), STEPS):
    if MODE == "rejoin" and i == KILL_STEP + 1 and ME != VICTIM:
        # Wait (at most 60 s) for the replacement to have joined the job: the next step's
        # check for returning replicas then waits for it to ask to join.
        marker, until = os.path.join(OUT, f"joined{VICTIM}"), time.time() + 60
        while not os.path.exists(marker) and time.time() < until:
            time.sleep(0.1)
    if ME == VICTIM and i == KILL_STEP and MODE != "replacement":
        with open(os.path.join(OUT, "killed"), "w") as fh:
            fh.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        state, metrics = survivor.step(state, global_batch)
    except RuntimeError as e:  # alive, but its replica lost a process
        if "its data replica lost" not in str(e):
            raise
        events["orphan"] = str(e)
        write()
        sys.stdout.flush()
        os._exit(0)
    saved.update({f"batch/{i}/{k}": v for k, v in global_batch(i).items()})
    loss = float(local(metrics["loss"]))
    replicas = int(survivor.mesh.shape["replicate"])
    events.setdefault("meshes", {})[str(i)] = [d.id for d in survivor.mesh.devices.flat]
    events["steps"].append([i, int(local(state.step)), loss, time.time(), replicas])
    events["recoveries"] = [list(r) for r in survivor.recoveries]
    write()
# NaN where this process holds no shard (4 x 2: a replica is two processes).
saved.update({f"final/{k}": local(v, np.nan) for k, v in state.params.items()})
np.savez(os.path.join(OUT, f"p{ME}{TAG}.npz"), **saved)
events["done"] = time.time()
write()
if ME == 0:  # it hosts the coordination service: stay until every other survivor is done
    until = time.time() + 30
    others = [f"p{k}" for k in range(jax.process_count()) if k not in (0, VICTIM)]
    others += [f"p{VICTIM}r"] if MODE == "rejoin" else []
    while time.time() < until:
        done = []
        for k in others:
            path = os.path.join(OUT, f"{k}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    ev = json.load(fh)
                done.append("done" in ev or "orphan" in ev)
        if all(done) and len(done) == len(others):
            break
        time.sleep(0.2)
sys.stdout.flush()
os._exit(0)
