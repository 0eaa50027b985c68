"""dp.Trainer on the global world, each process feeding only its own part of every batch.

Usage: ``train.py OUT CKPT_DIR KILL_AT [SIGNAL [STRATEGY]]`` under ``jaxcoll-run``
(STRATEGY ``fsdp``: ``Trainer(sync=dp.sync.FSDP())``, the params split over both processes;
``hsdp``: hybrid sharding on a ("replica", "shard") mesh whose rows are the processes:
``layout=dp.Layout(replicate="replica", shard="shard")`` (FSDP over ``shard``, HSDP) splits
the params over each process's devices and
replicates them across the processes, as HSDP across nodes).
Trains a small MLP for STEPS steps with ``fit(checkpoint=dp.Checkpointer(CKPT_DIR,
every=EVERY))`` and
writes the final params to ``OUT/p{k}.npz``. ``KILL_AT`` > 0: on the first run
(``JAXCOLL_RESTART_COUNT=0``) process 1 sends itself SIGNAL (``KILL``, the default, or
``TERM``: a preemption, which ``fit`` answers with a checkpoint at the next step boundary)
while producing batch KILL_AT; ``--max-restarts 1`` then resumes from the last checkpoint.
SIGNAL ``FAIL``: the process given local devices 4-7 raises while producing batch KILL_AT,
in every run (a bad accelerator): under ``jaxcoll-run --nprocs 1:2`` the job goes on without
it, on devices 0-3, from the last checkpoint, with the same global batches. ``PAUSE``:
process 1 sleeps while producing batch KILL_AT in its first run (``OUT/paused1`` marks it),
for a test that takes its node away meanwhile.
"""

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
from jax.experimental import multihost_utils  # noqa: E402

from jaxcoll import dp  # noqa: E402

OUT, CKPT, KILL_AT = sys.argv[1], sys.argv[2], int(sys.argv[3])
MODE = sys.argv[4] if len(sys.argv) > 4 else "KILL"
SIGNAL = getattr(signal, "SIG" + MODE, None)
# FAIL: the process on local devices 4-7 (a bad accelerator) raises at KILL_AT in every run.
BAD = MODE == "FAIL" and os.environ.get("JAXCOLL_LOCAL_DEVICE_IDS") == "4,5,6,7"
STRATEGY = sys.argv[5] if len(sys.argv) > 5 else "ddp"
STEPS, EVERY, BATCH = 12, 4, 32
ME = jax.process_index()
os.makedirs(OUT, exist_ok=True)
# PAUSE: process 1 sleeps while producing batch KILL_AT, once (OUT/paused1 marks it): the
# SLURM test takes its node away meanwhile.
PAUSED = os.path.join(OUT, "paused1") if MODE == "PAUSE" and ME == 1 else None
FIRST_RUN = os.environ.get("JAXCOLL_RESTART_COUNT", "0") == "0"

rng = np.random.default_rng(0)
X = rng.standard_normal((256, 4)).astype(np.float32)
Y = np.tanh(X @ rng.standard_normal((4, 1))).astype(np.float32)


def loss_fn(params, batch, rng):
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    err = h @ params["v"] - batch["y"]
    return jnp.mean(err**2), {}


if STRATEGY == "hsdp":
    # jax.make_mesh lays the devices out in process order: each row is one process.
    trainer = dp.Trainer(
        loss_fn,
        optax.adam(0.05),
        mesh=jax.make_mesh((jax.process_count(), jax.local_device_count()), ("replica", "shard")),
        layout=dp.Layout(replicate="replica", shard="shard"),  # HSDP: FSDP over "shard"
    )
    assert {d.process_index for d in trainer.mesh.devices[ME]} == {ME}
else:
    sync = dp.sync.FSDP() if STRATEGY == "fsdp" else dp.sync.DDP()
    trainer = dp.Trainer(loss_fn, optax.adam(0.05), sync=sync)
sharding = trainer.batch_sharding
# The rows of a global batch that this process's devices hold (devices are in global order).
mine = [k for k, d in enumerate(trainer.mesh.devices.reshape(-1)) if d.process_index == ME]
per_device = BATCH // trainer.layout.n
local_rows = np.concatenate([np.arange(k * per_device, (k + 1) * per_device) for k in mine])


class LocalBatches:
    """Global batches built from process-local rows only."""

    def __iter__(self):
        for s in range(STEPS):
            if KILL_AT and FIRST_RUN and ME == 1 and s == KILL_AT and SIGNAL is not None:
                os.kill(os.getpid(), SIGNAL)
            if KILL_AT and BAD and s == KILL_AT:
                raise RuntimeError(f"train.py: devices 4-7 fail for good at step {s}")
            if KILL_AT and PAUSED and s == KILL_AT and not os.path.exists(PAUSED):
                with open(PAUSED, "w") as fh:  # for the test, which now takes the node away
                    fh.write(str(os.getpid()))
                time.sleep(600)
            idx = (s * BATCH + local_rows) % len(X)
            yield {
                k: jax.make_array_from_process_local_data(sharding, v[idx])
                for k, v in (("x", X), ("y", Y))
            }


init = {
    "w": rng.standard_normal((4, 16)).astype(np.float32) * 0.5,
    "b": np.zeros(16, np.float32),
    "v": rng.standard_normal((16, 1)).astype(np.float32) * 0.5,
}
state = trainer.init(jax.tree_util.tree_map(jnp.asarray, init), jax.random.key(0))
# Saving is collective: every process builds its Checkpointer on the same directory.
state, history = trainer.fit(
    state,
    LocalBatches(),
    steps=STEPS,
    checkpoint=dp.Checkpointer(CKPT, every=EVERY),
    progress=False,
)
if STRATEGY != "ddp":  # every leaf is split over several devices: gather them
    assert all(not v.is_fully_replicated for v in state.params.values())
    params = multihost_utils.process_allgather(state.params, tiled=True)
else:
    params = {k: np.asarray(v.addressable_shards[0].data) for k, v in state.params.items()}
os.makedirs(OUT, exist_ok=True)
np.savez(os.path.join(OUT, f"p{ME}.npz"), step=np.asarray(jax.device_get(state.step)), **params)
print(
    f"process {ME}: finished at step {int(jax.device_get(state.step))} on {trainer.layout.n} "
    f"devices, {len(history)} steps in this run",
    flush=True,
)
