"""Small models, data and a single-device optax oracle shared by the dp tests."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcoll import dp


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(4)(x)


class CNN(nn.Module):
    """Conv + BatchNorm; axis_name="data" makes it SyncBatchNorm, None a plain one."""

    axis_name: str | None = "data"
    features: int = 4  # 8: every leaf but the last bias splits over 8 devices (ZeRO-1)

    @nn.compact
    def __call__(self, x, train: bool = False):
        # No conv bias: BatchNorm cancels it, so its exact gradient is 0 and Adam would turn
        # round-off (different summation order on 8 devices) into full-size steps.
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(axis_name=self.axis_name, momentum=0.9)(x, use_running_average=not train)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(4)(x)


def cross_entropy(logits, batch):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


class Twin(nn.Module):
    """Two independent copies of a model side by side: "adam" and "sgd".

    Trained with :func:`twin_optimizer`, one program checks two optimizers at once: Adam
    (a real optimizer state, sharded by ZeRO-1) and plain SGD, whose params are linear in the
    gradient: Adam divides a constant gradient scale away, SGD does not, so a gradient off
    by any factor (n, n/(n-1)) fails the SGD copy's comparison with the oracle.
    """

    make: type
    args: tuple = ()

    @nn.compact
    def __call__(self, x, train: bool = False):
        return {k: self.make(*self.args, name=k)(x, train) for k in TWIN}


TWIN = ("adam", "sgd")


def twin_loss(outputs, batch):
    """The sum of both copies' losses: each copy's gradient is its own loss's."""
    losses = {k: cross_entropy(outputs[k], batch)[0] for k in TWIN}
    return losses["adam"] + losses["sgd"], {f"{k}_loss": v for k, v in losses.items()}


def twin_optimizer(adam_lr: float = 1e-2, sgd_lr: float = 0.05):
    """Adam on the "adam" copy, plain SGD on the "sgd" copy (pytrees whose top keys are
    the copies, linen params or nnx pure dicts alike)."""

    def labels(params):
        return {k: jax.tree_util.tree_map(lambda _, k=k: k, v) for k, v in params.items()}

    return optax.multi_transform({"adam": optax.adam(adam_lr), "sgd": optax.sgd(sgd_lr)}, labels)


def batches(kind: str, k: int, size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """k global batches of random inputs with learnable labels."""
    rng = np.random.default_rng(seed)
    shape = (size, 16) if kind == "mlp" else (size, 8, 8, 1)
    out = []
    for _ in range(k):
        x = rng.normal(size=shape).astype(np.float32)
        y = (x.reshape(size, -1)[:, :4].argmax(-1)).astype(np.int32)
        out.append({"x": x, "y": y})
    return out


def oracle(
    model: dp.Model,
    optimizer,
    params,
    model_state,
    data,
    *,
    accum: int = 1,
    n: int = 8,
    grad_scale: float = 1.0,
):
    """K steps of plain single-device optax on the whole global batches.

    With ``accum > 1`` each step averages the gradients of ``accum`` global micro-batches
    (micro-batch i = global rows i, i + accum, ...: the same on every layout), threading
    BatchNorm state through them in order: what the Trainer's accumulation with SyncBatchNorm
    computes. ``grad_scale``
    injects a bug (n: the summed-instead-of-averaged gradient) for the negative control.
    """
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, model_state, opt_state, batch):
        def micro(i):
            def take(a):
                return a[i::accum]  # global micro-batch i: rows i, i + accum, ...

            return jax.tree_util.tree_map(take, batch)

        grads = None
        for i in range(accum):

            def loss(p, ms=model_state, i=i):
                value, (_, new_ms) = model.loss_fn(p, ms, micro(i), jax.random.key(0))
                return value, new_ms

            g, model_state = jax.grad(loss, has_aux=True)(params)
            grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
        grads = jax.tree_util.tree_map(lambda a: a * (grad_scale / accum), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), model_state, opt_state

    for batch in data:
        params, model_state, opt_state = step(params, model_state, opt_state, batch)
    return params, model_state


def twin_diffs(got, want) -> dict[str, float]:
    """:func:`max_rel_diff` of each copy ("adam", "sgd") of a twin's params or model state,
    found under the copy's name at any depth of the tree ({"batch_stats": {"sgd": ...}})."""

    def part(tree, k):
        while k not in tree:
            (tree,) = tree.values()
        return tree[k]

    return {k: max_rel_diff(part(got, k), part(want, k)) for k in TWIN}


def max_rel_diff(a, b) -> float:
    """Max over leaves of max|a - b| / max|b|."""
    diffs = jax.tree_util.tree_map(
        lambda x, y: float(
            np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
            / max(float(np.max(np.abs(np.asarray(y, np.float64)))), 1e-30)
        ),
        a,
        b,
    )
    return max(jax.tree_util.tree_leaves(diffs))


def token_batches(steps: int, batch: int, length: int, vocab: int, seed: int = 0) -> list:
    """``steps`` batches of ``batch`` random token sequences: ``x`` the first ``length``
    tokens of each, ``y`` the next token at every position (int32)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.integers(0, vocab, size=(batch, length + 1))
        out.append({"x": x[:, :-1].astype(np.int32), "y": x[:, 1:].astype(np.int32)})
    return out
