"""Deterministic global batches from in-memory arrays: batch s is a pure function of s."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np

from ..._core.typing import PyTree


class Batches:
    """Shuffled global batches over in-memory arrays, addressable by step for exact resumes.

    ``batches[s]`` is the global batch of step s: epoch ``s // len(batches)`` is a permutation
    drawn from ``seed`` and the epoch number, so a run resumed at step s sees exactly the
    batches an uninterrupted run would. Like ``DataLoader(drop_last=True)``, the examples
    that do not fill a whole batch at the end of an epoch are skipped (a different subset
    each epoch), so every batch has ``batch_size`` examples and the gradient mean stays exact.

    Args:
        arrays: a pytree of NumPy arrays sharing their leading (example) dim.
        batch_size: the global batch size.
        shuffle: draw a new permutation each epoch; otherwise batches are in order.
        seed: the shuffle seed.
        drop_last: skip the incomplete last batch (True) or yield it short (False; then
            :meth:`Trainer.step` rejects it unless its size still splits over the devices).

    Example::

        >>> data = Batches({"x": np.zeros((100, 3)), "y": np.zeros(100, int)}, batch_size=32)
        >>> len(data), data[0]["x"].shape
        (3, (32, 3))
    """

    def __init__(
        self,
        arrays: PyTree,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        leaves = jax.tree_util.tree_leaves(arrays)
        if not leaves:
            raise ValueError("Batches: arrays holds no array; pass a pytree of NumPy arrays.")
        sizes = {np.shape(leaf)[0] for leaf in leaves}
        if len(sizes) != 1:
            raise ValueError(
                f"Batches: the arrays disagree on the number of examples "
                f"(leading sizes {sorted(sizes)}); give every array one row per "
                f"example."
            )
        self.num_examples = sizes.pop()
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise TypeError(f"Batches: batch_size must be an int, got {batch_size!r} instead.")
        if not 1 <= batch_size <= self.num_examples:
            raise ValueError(
                f"Batches: batch_size={batch_size} must be between 1 and the "
                f"number of examples ({self.num_examples})."
            )
        self.arrays = jax.tree_util.tree_map(np.asarray, arrays)
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.num_examples // self.batch_size
        return -(-self.num_examples // self.batch_size)

    def __getitem__(self, step: int) -> PyTree:
        """The global batch of step ``step`` (any non-negative int; epochs repeat)."""
        epoch, i = divmod(int(step), len(self))
        order = np.arange(self.num_examples)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
        idx = order[i * self.batch_size : (i + 1) * self.batch_size]
        return jax.tree_util.tree_map(lambda a: a[idx], self.arrays)

    def epoch(self, epoch: int = 0) -> Iterator[PyTree]:
        """Iterate over the batches of one epoch."""
        start = epoch * len(self)
        return (self[start + i] for i in range(len(self)))

    def in_order(self) -> Iterator[PyTree]:
        """Every example exactly once, in order, in batches of ``batch_size`` (the last one
        short): what :meth:`Trainer.evaluate` iterates over, whatever ``shuffle`` and
        ``drop_last`` say."""
        for lo in range(0, self.num_examples, self.batch_size):
            rows = slice(lo, lo + self.batch_size)
            yield jax.tree_util.tree_map(lambda a, rows=rows: a[rows], self.arrays)


def leading_size(api: str, batch: PyTree) -> int:
    """The number of examples in a global batch: the leading size every array shares.

    Raises:
        ValueError: the batch holds no array, an array is a scalar, the arrays disagree, or
            the batch is empty.
    """
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise ValueError(
            f"{api}: the batch holds no array; pass a pytree of arrays with one row per example."
        )
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            f"{api}: every array in the batch needs the same leading (example) "
            f"dim, got leading sizes {sizes}."
        )
    size = np.shape(leaves[0])[0]  # every leaf's, checked above
    if size == 0:
        raise ValueError(
            f"{api}: the batch has 0 examples (every array's leading dim is "
            f"empty); a mean over no examples is NaN. Skip empty batches."
        )
    return int(size)


def placed_as(batch: PyTree, sharding: jax.sharding.Sharding) -> bool:
    """Whether every array of ``batch`` is a ``jax.Array`` placed as ``sharding`` already (a
    batch placed once and stepped on again: ``jax.device_put`` would return it as it is)."""
    leaves = jax.tree_util.tree_leaves(batch)
    return all(isinstance(x, jax.Array) and x.sharding == sharding for x in leaves)
