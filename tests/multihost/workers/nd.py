"""A 3-D layout across processes: FSDP over 2 x tensor over 2 x pipeline over 2.

Usage: ``nd.py OUT`` under ``jaxcoll-run --nprocs 2 --devices-per-proc 4``. The mesh
``(data 2, tensor 2, pipe 2)`` from ``jax.make_mesh`` puts the data axis across the two
processes and the tensor and pipeline axes inside each; trains nd_model's twin copies for
its STEPS batches and writes the final params (whole, from every process) to ``OUT/p{k}.npz``.
"""

import os
import sys

import jaxcoll

jaxcoll.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from nd_model import SPECS, data, loss_fn, optimizer, params0  # noqa: E402

from jaxcoll import dp  # noqa: E402

OUT = sys.argv[1]
ME = jax.process_index()

mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "pipe"))
# Each process holds one data replica: its 4 devices are the tensor x pipe grid.
assert {d.process_index for d in mesh.devices[ME].reshape(-1)} == {ME}
trainer = dp.Trainer(
    loss_fn,
    optimizer(),
    mesh=mesh,
    axis_name="data",
    sync=dp.sync.FSDP(),
    layout=dp.Layout(tensor="tensor", pipeline="pipe"),
)
state = trainer.init(params0(), jax.random.key(1), specs=SPECS)
for batch in data():  # every process passes the same global batch
    state, metrics = trainer.step(state, batch)
params = trainer.host_params(state)
flat = {
    jax.tree_util.keystr(path): leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
}
os.makedirs(OUT, exist_ok=True)
np.savez(os.path.join(OUT, f"p{ME}.npz"), **flat)
print(f"process {ME}: loss {float(metrics['loss']):.4f}", flush=True)
