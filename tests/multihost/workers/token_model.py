"""The token file, model, Trainer and NumPy oracle of tests/multihost/workers/grain_train.py,
shared with tests/dp/test_grain_data.py (which runs the same training in one process).

The oracle is written from the file format and the documented order alone: the windows of a
file of ``n`` tokens are ``(n - BLOCK - 1) // STRIDE + 1``; epoch ``e`` visits them in the
order ``np.random.default_rng([seed, e]).permutation(windows)``; global batch ``s`` is the
examples ``s * BATCH ...`` of that endless order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcoll import dp

VOCAB, TOKENS, BLOCK, STRIDE, BATCH, SEED = 32, 2000, 8, 5, 16, 7  # 399 windows


def write_tokens(path) -> None:
    """A corpus of ``TOKENS`` uint16 tokens, as nanoGPT's prepare.py writes train.bin."""
    rng = np.random.default_rng(1)
    rng.integers(0, VOCAB, TOKENS).astype(np.uint16).tofile(path)


def oracle_ids(step: int, tokens: int = TOKENS, seed: int = SEED) -> np.ndarray:
    """The window ids of global batch ``step``, row by row: NumPy only."""
    windows = (tokens - BLOCK - 1) // STRIDE + 1
    ids = []
    for g in range(step * BATCH, (step + 1) * BATCH):
        epoch, pos = divmod(g, windows)
        ids.append(np.random.default_rng([seed, epoch]).permutation(windows)[pos])
    return np.array(ids)


def oracle_x(path, ids: np.ndarray) -> np.ndarray:
    """The inputs of windows ``ids``, read from the file with np.fromfile."""
    tokens = np.fromfile(path, np.uint16)
    return np.stack([tokens[i * STRIDE : i * STRIDE + BLOCK] for i in ids]).astype(np.int32)


def data(path, trainer: dp.Trainer | None) -> dp.TokenBatches:
    windows = dp.TokenWindows(path, BLOCK, stride=STRIDE)
    sharding = None if trainer is None else trainer.batch_sharding
    return dp.TokenBatches(windows, BATCH, seed=SEED, sharding=sharding)


def loss_fn(params, batch, rng):
    """A bigram model: next-token cross-entropy from an embedding and a projection."""
    logits = params["emb"][batch["x"]] @ params["out"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)
    return jnp.mean(nll), {}


def init_params():
    rng = np.random.default_rng(0)
    return {
        "emb": jnp.asarray(rng.standard_normal((VOCAB, 16)).astype(np.float32) * 0.1),
        "out": jnp.asarray(rng.standard_normal((16, VOCAB)).astype(np.float32) * 0.1),
    }


class Recording(dp.Trainer):
    """A Trainer that keeps, for every step it takes, the ids of the batch rows this process
    holds: ``seen[step] = {row: id}`` (read from the placed batch, as the step receives it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[int, dict[int, int]] = {}

    def step(self, state, batch):
        step = int(jax.device_get(state.step))
        rows = self.seen.setdefault(step, {})
        ids = batch["id"]
        if isinstance(ids, jax.Array):
            for shard in ids.addressable_shards:
                lo = shard.index[0].start or 0
                for k, v in enumerate(np.asarray(shard.data)):
                    rows[lo + k] = int(v)
        else:
            rows.update(enumerate(int(v) for v in ids))
        return super().step(state, batch)


def trainer(mesh=None, sync=None) -> Recording:
    kwargs = {} if sync is None else {"sync": sync}
    return Recording(loss_fn, optax.adam(0.05), mesh=mesh, **kwargs)
