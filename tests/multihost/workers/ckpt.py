"""Checkpoints and host copies under multi-process FSDP, then a save made on one process.

Usage: ``ckpt.py OUT CKPT_DIR SOLO_DIR`` under ``jaxcoll-run --nprocs 2 --devices-per-proc
4``. Trains ``ckpt_model.Net`` with ``sync=dp.sync.FSDP()`` (every split leaf split over both
processes): ``fit`` to step SAVED_AT with a checkpoint in CKPT_DIR, then on to END without
one. Writes ``OUT/p{k}.npz``: ``Trainer.host_params`` at SAVED_AT (``saved/...``) and at END
(``end/...``), and the params of ``Trainer.to_module`` at SAVED_AT (``module/...``). Then
process 0 alone saves into SOLO_DIR (``rendezvous_timeout=5``) while process 1 goes on to
the next step: process 0 must raise, naming Checkpointer.save, and the job end on it.
"""

import os
import sys

import jaxcoll

jaxcoll.init()

import ckpt_model as cm  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxcoll import dp  # noqa: E402

OUT, CKPT, SOLO = sys.argv[1], sys.argv[2], sys.argv[3]
ME = jax.process_index()

trainer = cm.trainer(dp.sync.FSDP())
sharding = trainer.batch_sharding
mine = [k for k, d in enumerate(trainer.mesh.devices.reshape(-1)) if d.process_index == ME]
per_device = cm.BATCH // trainer.layout.n
local = np.concatenate([np.arange(k * per_device, (k + 1) * per_device) for k in mine])


def batch(s):
    """Step s's global batch, built from this process's rows only."""
    whole = cm.global_batch(s)
    return {k: jax.make_array_from_process_local_data(sharding, v[local]) for k, v in whole.items()}


class Batches:
    def __iter__(self):
        for s in range(cm.END + 1):
            yield batch(s)


params, model_state = trainer.model.init(jax.random.key(0), cm.global_batch(0))
state = trainer.init(params, jax.random.key(1), model_state=model_state)
state, _ = trainer.fit(
    state,
    Batches(),
    steps=cm.SAVED_AT,
    checkpoint=dp.Checkpointer(CKPT, every=cm.SAVED_AT),
    progress=False,
)
assert not all(x.is_fully_addressable for x in jax.tree_util.tree_leaves(state.params))
whole = trainer.host_params(state)  # on every process: the whole params, as NumPy arrays
module = trainer.to_module(state)  # collective too: every process gets the whole model
rows = {**cm.flat(whole, "saved"), **cm.flat(module.variables["params"], "module")}
state, _ = trainer.fit(state, Batches(), steps=cm.END, progress=False)
rows.update(cm.flat(trainer.host_params(state), "end"))
os.makedirs(OUT, exist_ok=True)
np.savez(os.path.join(OUT, f"p{ME}.npz"), **rows)
print(f"process {ME}: wrote the params of steps {cm.SAVED_AT} and {cm.END}", flush=True)

# A torch habit: saving on the master process only. Process 1 goes on to the next step, a
# collective process 0 never joins; process 0's save must fail at once, and say why.
if ME == 0:
    dp.Checkpointer(SOLO, rendezvous_timeout=5).save(state)
else:
    jax.block_until_ready(trainer.step(state, batch(cm.END)))
print(f"process {ME}: got past the solo save", flush=True)
