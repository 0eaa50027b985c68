"""A process lost while a save is being committed: the other one is not aborted.

Usage: ``ckpt_lost.py OUT CKPT_DIR`` under ``jaxcoll-run --nprocs 2 --devices-per-proc 4
--max-restarts 1``. ``Trainer.fit`` trains a small MLP (DDP over the 8 devices, each process
feeding only its rows of every global batch) for STEPS steps with
``dp.Checkpointer(CKPT_DIR, every=EVERY)``: the saves are asynchronous, and fit waits for each
one's commit two steps later. In the first run the save of step KILL_AT is waited for at once
on both processes (``Checkpointer.wait``, so that no process is inside a collective), and
process 1 kills itself (SIGKILL) inside that commit, when its shards are written and it is
about to meet process 0 at orbax's ``async_write_complete`` barrier: step KILL_AT can never be
committed, and process 0 must end with jaxcoll's line naming process 1. The launcher's
restart then resumes from step KILL_AT - EVERY, the newest committed one, and trains to STEPS.
Writes ``OUT/p{k}.npz`` (the final params and step, the first step this run trained).

``ckpt_lost.py OUT CKPT_DIR late``: a node lost after a save, not during it. In the first run
process 1's commit of step KILL_AT - EVERY is slow (its meeting at ``async_write_complete``
comes 1.5 s late, as on a loaded machine or a slow filesystem), and process 1 kills itself
while it fetches the batch of step KILL_AT + 1 (after fit dispatched step KILL_AT): fit must
have waited for that commit two steps after the save, so the restart resumes from step
KILL_AT - EVERY.
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
from ckpt_lost_model import BATCH, EVERY, INIT, KILL_AT, STEPS, global_batch, loss_fn  # noqa: E402
from orbax.checkpoint._src.checkpointers import async_checkpointer  # noqa: E402

from jaxcoll import dp  # noqa: E402

OUT, CKPT = sys.argv[1], sys.argv[2]
LATE = sys.argv[3:] == ["late"]
ME = jax.process_index()
FIRST_RUN = os.environ.get("JAXCOLL_RESTART_COUNT", "0") == "0"


if FIRST_RUN and ME == 1:
    # orbax's commit thread meets the other processes through its _AsyncManager's _sync_fn
    # (whatever barrier_sync_fn it was given): process 1 dies on its way to the meeting of
    # step KILL_AT, its shards written.
    manager_init = async_checkpointer._AsyncManager.__init__

    def dying_init(self, *args, **kwargs):
        manager_init(self, *args, **kwargs)
        meet = self._sync_fn

        def dying(key, timeout_ms):
            if LATE and key.endswith(f"async_write_complete.{KILL_AT - EVERY}"):
                time.sleep(1.5)  # a slow commit: two steps take milliseconds
            elif not LATE and key.endswith(f"async_write_complete.{KILL_AT}"):
                # Once process 0 is past the save's blocking part (whose collectives a loss
                # would break: another failure, not this test's) and waits for the commit.
                time.sleep(1.0)
                os.kill(os.getpid(), signal.SIGKILL)
            return meet(key, timeout_ms)

        self._sync_fn = dying

    async_checkpointer._AsyncManager.__init__ = dying_init


class WaitAtKill(dp.Checkpointer):
    """The save of step KILL_AT waited for at once in the first run (no step goes on)."""

    def save(self, state):
        # The step is read before the save: its commit may kill process 1 at once, and a
        # collective (this read of a global array) may not be under way then.
        at_kill = FIRST_RUN and not LATE and int(jax.device_get(state.step)) == KILL_AT
        super().save(state)
        if at_kill:
            self.wait()


if __name__ == "__main__":
    trainer = dp.Trainer(loss_fn, optax.adam(0.05))
    sharding = trainer.batch_sharding
    mine = [k for k, d in enumerate(trainer.mesh.devices.reshape(-1)) if d.process_index == ME]
    per_device = BATCH // trainer.layout.n
    rows = np.concatenate([np.arange(k * per_device, (k + 1) * per_device) for k in mine])

    class Batches:
        def __iter__(self):
            for s in range(STEPS):
                if LATE and FIRST_RUN and ME == 1 and s == KILL_AT:
                    os.kill(os.getpid(), signal.SIGKILL)  # step KILL_AT was dispatched
                whole = global_batch(s)
                yield {
                    k: jax.make_array_from_process_local_data(sharding, v[rows])
                    for k, v in whole.items()
                }

    state = trainer.init(jax.tree_util.tree_map(jnp.asarray, INIT), jax.random.key(0))
    state, history = trainer.fit(
        state, Batches(), steps=STEPS, checkpoint=WaitAtKill(CKPT, every=EVERY), progress=False
    )
    params = {k: np.asarray(v.addressable_shards[0].data) for k, v in state.params.items()}
    os.makedirs(OUT, exist_ok=True)
    first = history[0]["step"] if history else STEPS + 1
    np.savez(
        os.path.join(OUT, f"p{ME}.npz"), step=int(jax.device_get(state.step)), first=first, **params
    )
    print(f"process {ME}: trained steps {first}-{STEPS} in this run", flush=True)
