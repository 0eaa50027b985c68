"""Data, loss and a one-device reference trainer (``jax.jit`` + ``optax.sgd``) for the test models.

The data are random walks over the vocabulary: each document starts at a random token and
moves by +1 or +2 (mod ``vocab``) at random, so the next token is predictable to within two
choices and a few steps of SGD visibly lower the loss (from about 4.6 towards ln 2).

``batches(..., packed=True)`` packs several such documents into each row: ``segment_ids``
numbers them 1, 2, ... within the row, ``positions`` restart at 0 in each, and ``targets`` are
each document's own next token (a row is exactly the concatenation of independent documents).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

LR = 0.5
"""Learning rate of the reference ``optax.sgd``."""


def _walk(rng: np.random.Generator, length: int, vocab: int) -> np.ndarray:
    """One document of ``length + 1`` tokens (inputs and the target after the last)."""
    start = rng.integers(vocab)
    steps = rng.integers(1, 3, size=length)
    return (start + np.concatenate([[0], np.cumsum(steps)])) % vocab


def _segment_lengths(rng: np.random.Generator, seq: int) -> list[int]:
    """Split a row of ``seq`` tokens into 1 to 3 documents of at least 2 tokens each."""
    n_cuts = int(rng.integers(0, 3)) if seq >= 6 else 0
    cuts = sorted(rng.choice(np.arange(2, seq - 1), size=n_cuts, replace=False).tolist())
    bounds = [0, *cuts, seq]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if min(lengths) < 2:  # adjacent cuts: fall back to one document
        return [seq]
    return lengths


def _row(rng: np.random.Generator, seq: int, vocab: int, packed: bool) -> tuple[np.ndarray, ...]:
    lengths = _segment_lengths(rng, seq) if packed else [seq]
    tokens, targets, positions, segments = [], [], [], []
    for i, n in enumerate(lengths):
        doc = _walk(rng, n, vocab)
        tokens.append(doc[:-1])
        targets.append(doc[1:])
        positions.append(np.arange(n))
        segments.append(np.full(n, i + 1))
    return tuple(np.concatenate(a).astype(np.int32) for a in (tokens, targets, positions, segments))


def batches(
    steps: int,
    batch: int = 16,
    seq: int = 16,
    seed: int = 0,
    packed: bool = False,
    vocab: int = 64,
) -> Iterator[dict[str, np.ndarray]]:
    """Yield ``steps`` batches of ``(batch, seq)`` int32 arrays from a fixed NumPy RNG.

    Args:
        steps: number of batches.
        batch: rows per batch.
        seq: tokens per row.
        seed: seed of ``np.random.default_rng``; the same seed gives the same batches.
        packed: pack 1 to 3 documents per row and add ``"segment_ids"``.
        vocab: vocabulary size.

    Yields:
        ``{"tokens", "positions", "targets"}`` (and ``"segment_ids"`` when ``packed``).
    """
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = [_row(rng, seq, vocab, packed) for _ in range(batch)]
        tokens, targets, positions, segments = (np.stack(a) for a in zip(*rows))
        out = {"tokens": tokens, "positions": positions, "targets": targets}
        if packed:
            out["segment_ids"] = segments
        yield out


def loss(logits: jax.Array, batch: dict[str, Any]) -> jax.Array:
    """Mean token cross-entropy of ``logits`` ``(B, T, vocab)`` against ``batch["targets"]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _model_inputs(batch: dict[str, Any]) -> tuple[Any, Any, Any]:
    return batch["tokens"], batch["positions"], batch.get("segment_ids")


def _train(apply_fn, params, steps: int, lr: float, data_kw: dict[str, Any]):
    """Plain jitted SGD on one device; ``apply_fn(params, tokens, positions, segment_ids)``."""
    device = jax.devices()[0]
    params = jax.device_put(params, device)
    opt = optax.sgd(lr)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            return loss(apply_fn(p, *_model_inputs(batch)), batch)

        value, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for b in batches(steps, **data_kw):
        params, opt_state, value = step(params, opt_state, jax.device_put(b, device))
        losses.append(float(value))
    return losses, params


def train_nnx(
    model: nnx.Module, steps: int, *, lr: float = LR, **data_kw: Any
) -> tuple[list[float], dict[str, Any]]:
    """Train a copy of an nnx model on one device with ``optax.sgd(lr)``.

    Args:
        model: the nnx model (left unchanged); called as ``model(tokens, positions, segment_ids)``.
        steps: number of steps, one batch of ``batches(steps, **data_kw)`` each.
        lr: SGD learning rate.
        **data_kw: passed to ``batches`` (``batch``, ``seq``, ``seed``, ``packed``, ``vocab``).

    Returns:
        The per-step losses and the final parameters as a pure dict (``nnx.to_pure_dict``).
    """
    graphdef, state = nnx.split(model)

    def apply_fn(state, tokens, positions, segment_ids):
        return nnx.merge(graphdef, state)(tokens, positions, segment_ids)

    losses, state = _train(apply_fn, state, steps, lr, data_kw)
    return losses, nnx.to_pure_dict(state)


def train_linen(
    module: Any, params: Any, steps: int, *, lr: float = LR, **data_kw: Any
) -> tuple[list[float], Any]:
    """Train linen ``params`` (the ``"params"`` tree of ``module``) on one device with SGD.

    Args:
        module: the linen module, applied as ``module.apply({"params": p}, tokens, ...)``.
        params: its ``"params"`` collection.
        steps: number of steps.
        lr: SGD learning rate.
        **data_kw: passed to ``batches``.

    Returns:
        The per-step losses and the final ``params``.
    """

    def apply_fn(params, tokens, positions, segment_ids):
        return module.apply({"params": params}, tokens, positions, segment_ids)

    return _train(apply_fn, params, steps, lr, data_kw)


__all__ = ["LR", "batches", "loss", "train_linen", "train_nnx"]
