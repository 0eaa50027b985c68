"""The model, data and Trainer of tests/multihost/workers/ckpt.py, shared with the test that
checks its results in one process (tests/multihost/test_checkpoint.py)."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

from jaxcoll import dp

SAVED_AT, END, BATCH = 2, 4, 32

_rng = np.random.default_rng(0)
X = _rng.standard_normal((256, 8)).astype(np.float32)
Y = np.tanh(X @ _rng.standard_normal((8, 4))).astype(np.float32)


class Net(nn.Module):
    """Leaves (8, 16), (16,), (16, 4) split over 8 devices; (4,) over 4 only; (3, 5) never."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        c = self.param("c", nn.initializers.normal(1.0), (3, 5))
        return nn.Dense(4)(jnp.tanh(nn.Dense(16)(x))) + jnp.mean(c)


def mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2), {}


def trainer(sync, mesh=None):
    return dp.Trainer(dp.Linen(Net(), mse), optax.adam(0.05), sync=sync, mesh=mesh)


def global_batch(s):
    """Step ``s``'s global batch (rows in device order)."""
    idx = (s * BATCH + np.arange(BATCH)) % len(X)
    return {"x": X[idx], "y": Y[idx]}


def flat(params, prefix):
    """``{prefix/path: array}`` of a params tree, for np.savez."""
    return {f"{prefix}/" + "/".join(k): np.asarray(v) for k, v in _items(params, ())}


def _items(tree, path):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _items(v, (*path, k))
        else:
            yield (*path, k), v
