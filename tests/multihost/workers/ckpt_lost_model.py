"""The model and data of tests/multihost/workers/ckpt_lost.py, shared with the test that checks
its result against an uninterrupted run in one process (tests/multihost/test_checkpoint.py)."""

import jax.numpy as jnp
import numpy as np

STEPS, EVERY, KILL_AT, BATCH = 8, 2, 6, 32

_rng = np.random.default_rng(0)
X = _rng.standard_normal((256, 4)).astype(np.float32)
Y = np.tanh(X @ _rng.standard_normal((4, 1))).astype(np.float32)
INIT = {
    "w": _rng.standard_normal((4, 16)).astype(np.float32) * 0.5,
    "b": np.zeros(16, np.float32),
    "v": _rng.standard_normal((16, 1)).astype(np.float32) * 0.5,
}


def loss_fn(params, batch, rng):
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    return jnp.mean((h @ params["v"] - batch["y"]) ** 2), {}


def global_batch(s):
    """Step ``s``'s global batch (rows in device order)."""
    idx = (s * BATCH + np.arange(BATCH)) % len(X)
    return {"x": X[idx], "y": Y[idx]}
