"""Data-parallel training over several processes: each feeds only its own part of the batch.

Run (2 processes x 4 simulated CPU devices on this host, about 10 s)::

    jaxcoll-run --nprocs 2 --devices-per-proc 4 examples/multihost_train.py
    python -m jaxcoll.run --nprocs 2 --devices-per-proc 4 examples/multihost_train.py

Add ``--max-restarts 1`` and kill a worker: the job restarts and resumes from the last
checkpoint in ``CKPT_DIR`` (default: a temporary directory per launcher). Run alone
(``python examples/multihost_train.py``) it is one process and ``jaxcoll.init()`` does
nothing. Prints the loss from process 0 only; expect it to fall from about 2.2 to about 0.3
in 40 steps.
"""

import os
import tempfile

import jaxcoll

jaxcoll.init()  # first, before any other JAX call: joins the job jaxcoll-run describes

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxcoll import dp  # noqa: E402

STEPS = 40  # optimizer steps
BATCH = 64  # global batch: split over every device of every process
# One directory per launcher (the parent of every process, the same across restarts).
CKPT_DIR = os.environ.get(
    "CKPT_DIR", os.path.join(tempfile.gettempdir(), f"jaxcoll_mh_ckpt_{os.getppid()}")
)
ME = jax.process_index()

rng = np.random.default_rng(0)  # every process draws the same dataset
X = rng.standard_normal((1024, 4)).astype(np.float32)
Y = np.sin(X @ rng.standard_normal((4, 1))).astype(np.float32)


def loss_fn(params, batch, rng):
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    return jnp.mean((h @ params["v"] - batch["y"]) ** 2), {}


trainer = dp.Trainer(loss_fn, optax.adam(0.03))  # mesh: every device of every process
sharding = trainer.batch_sharding
# Rank k holds rows k*per .. (k+1)*per of each batch; this process builds only its ranks' rows.
per = BATCH // trainer.layout.n
mine = [k for k, d in enumerate(trainer.mesh.devices.reshape(-1)) if d.process_index == ME]
rows = np.concatenate([np.arange(k * per, (k + 1) * per) for k in mine])


def batches():
    for s in range(STEPS):
        idx = (s * BATCH + rows) % len(X)
        yield {
            "x": jax.make_array_from_process_local_data(sharding, X[idx]),
            "y": jax.make_array_from_process_local_data(sharding, Y[idx]),
        }


params = {
    "w": rng.standard_normal((4, 32)).astype(np.float32) * 0.5,
    "b": np.zeros(32, np.float32),
    "v": rng.standard_normal((32, 1)).astype(np.float32) * 0.2,
}
state = trainer.init(jax.tree_util.tree_map(jnp.asarray, params), jax.random.key(0))
# Gradients cross devices (and processes) inside trainer.step: one averaged all-reduce.
# Saving a checkpoint is collective: every process passes a Checkpointer on the same directory.
state, history = trainer.fit(
    state, batches(), steps=STEPS, checkpoint=dp.Checkpointer(CKPT_DIR, every=10), progress=False
)
if ME == 0 and history:
    print(
        f"{jax.process_count()} process(es) x {jax.local_device_count()} devices: "
        f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} "
        f"after step {int(jax.device_get(state.step))}"
    )
