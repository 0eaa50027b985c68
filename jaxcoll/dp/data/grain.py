"""Token windows read from a file on disk, through grain: global batch s is a pure function
of s, and each process reads only its own rows of it.

A corpus is a flat binary file of token ids (``uint16``, as nanoGPT's ``prepare.py`` writes
it with ``np.array(ids, np.uint16).tofile(path)``), read through ``np.memmap``: nothing is
loaded whole. :class:`TokenWindows` is the grain data source over it (example ``i`` is the
window of ``block_size + 1`` tokens at offset ``i * stride``, split into input and
next-token target); :class:`TokenBatches` orders the windows (a new NumPy permutation each
epoch, drawn from the seed and the epoch), cuts the order into global batches and builds
grain's pipeline for this process's rows: ``MapDataset`` (index-addressable, so any step is
reached without reading the ones before it), ``batch``, ``to_iter_dataset`` with reading
threads and a prefetch buffer (``grain.ReadOptions``). Each batch is placed with
``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Sharding

from ..._core.checks import check_static_int
from ..checks import as_path

if TYPE_CHECKING:
    import grain

__all__ = ["TokenBatches", "TokenWindows"]


class TokenWindows:
    """The windows of a token file: a grain data source (``len`` and ``[i]``).

    Example ``i`` is ``tokens[i * stride : i * stride + block_size + 1]`` split into the
    input ``x`` (its first ``block_size`` tokens) and the target ``y`` (its last
    ``block_size``: the next token at every position), both ``int32``, with ``id``: ``i``
    itself, an ``int32`` that travels with the example through the pipeline (the window's
    offset in the file is ``id * stride``). The file is opened with
    ``np.memmap(path, dtype, mode="r")`` in each process that reads (the source pickles
    without it, for grain's worker processes).

    Args:
        path: the token file: token ids one after another, no header (nanoGPT's
            ``train.bin``).
        block_size: the tokens of one input (the context length).
        stride: tokens between the starts of consecutive windows; default ``block_size``
            (windows that do not overlap; ``stride=1``: every offset starts one).
        dtype: the file's token type: ``np.uint16`` (nanoGPT's, vocabularies up to
            65536) or ``np.uint32``.

    Example::

        >>> np.arange(100, dtype=np.uint16).tofile("tokens.bin")
        >>> windows = dp.TokenWindows("tokens.bin", block_size=8)
        >>> len(windows), windows[2]["x"][:3], windows[2]["y"][:3], windows[2]["id"]
        (12, array([16, 17, 18], dtype=int32), array([17, 18, 19], dtype=int32), np.int32(2))
    """

    def __init__(
        self,
        path: str | os.PathLike,
        block_size: int,
        *,
        stride: int | None = None,
        dtype: Any = np.uint16,
    ) -> None:
        api = "TokenWindows"
        self.path = as_path(api, "path", path)
        if not os.path.isfile(self.path):
            raise ValueError(
                f"{api}: path={os.fspath(path)!r} is not a file; pass a token file written "
                f"with np.array(ids, np.uint16).tofile(path)."
            )
        self.block_size = check_static_int(api, "block_size", block_size)
        if self.block_size < 1:
            raise ValueError(f"{api}: block_size={block_size} must be at least 1.")
        self.stride = self.block_size if stride is None else check_static_int(api, "stride", stride)
        if self.stride < 1:
            raise ValueError(f"{api}: stride={stride} must be at least 1 (tokens).")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise TypeError(
                f"{api}: dtype={self.dtype} is not a token type; pass np.uint16 (nanoGPT's "
                f"files) or np.uint32 (vocabularies over 65536)."
            )
        size = os.path.getsize(self.path)
        if size % self.dtype.itemsize:
            raise ValueError(
                f"{api}: {self.path} has {size} bytes, not a whole number of {self.dtype} "
                f"tokens ({self.dtype.itemsize} bytes each); pass the dtype it was written with."
            )
        self.num_tokens = size // self.dtype.itemsize
        if self.num_tokens < self.block_size + 1:
            raise ValueError(
                f"{api}: {self.path} holds {self.num_tokens} tokens, fewer than one window "
                f"(block_size + 1 = {self.block_size + 1}); pass a smaller block_size."
            )
        self._len = (self.num_tokens - self.block_size - 1) // self.stride + 1
        if self._len > np.iinfo(np.int32).max:
            raise ValueError(
                f"{api}: {self._len} windows do not fit the int32 ids; pass a larger stride."
            )
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        """The whole file as a read-only ``np.memmap`` (opened on first use)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        if not 0 <= i < self._len:
            raise IndexError(f"TokenWindows: window {i} is out of range (0..{self._len - 1}).")
        start = i * self.stride
        window = np.asarray(self.tokens[start : start + self.block_size + 1], np.int32)
        return {"x": window[:-1], "y": window[1:], "id": np.int32(i)}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}  # each process maps the file itself

    def __repr__(self) -> str:  # grain's checkpoints name the source by it
        return (
            f"TokenWindows({self.path!r}, block_size={self.block_size}, "
            f"stride={self.stride}, dtype=np.{self.dtype.name})"
        )


class _Order:
    """Global example ``g`` -> its window: epoch ``g // n``'s permutation, position
    ``g % n`` (the windows in order without shuffle). A grain map, picklable."""

    def __init__(self, source: TokenWindows, seed: int, shuffle: bool) -> None:
        self.source, self.seed, self.shuffle = source, seed, shuffle
        self._perms: dict[int, np.ndarray] = {}

    def window(self, g: int) -> int:
        epoch, pos = divmod(int(g), len(self.source))
        if not self.shuffle:
            return pos
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.source))
            self._perms = {epoch: perm, **{e: p for e, p in self._perms.items() if e == epoch - 1}}
        return int(perm[pos])

    def __call__(self, g: int) -> dict[str, np.ndarray]:
        return self.source[self.window(g)]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_perms": {}}


class _Rows:
    """Local example ``i`` -> global example: row ``rows[i % m]`` of global batch ``i // m``."""

    def __init__(self, batch_size: int, rows: np.ndarray) -> None:
        self.batch_size, self.rows = batch_size, rows

    def __call__(self, i: int) -> int:
        step, k = divmod(int(i), len(self.rows))
        return step * self.batch_size + int(self.rows[k])


def process_rows(sharding: Sharding, batch_size: int) -> np.ndarray:
    """The rows of a global batch of ``batch_size`` examples that this process's devices
    hold under ``sharding`` (split along the leading dim), in order: what this process
    reads and gives ``jax.make_array_from_process_local_data``."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map((batch_size,)).values():
        assert index is not None  # a shape was given
        rows.update(range(*index[0].indices(batch_size)))
    return np.array(sorted(rows), np.int64)


class TokenBatches:
    """Global batches of token windows from a file, addressable by step, each process
    reading only its own rows: the data a :meth:`Trainer.fit` resumes exactly from.

    Global batch ``s`` holds the examples ``s * batch_size`` to ``(s + 1) * batch_size - 1``
    of an endless sequence in which epoch ``e`` is every window of ``source`` once, in the
    order ``np.random.default_rng([seed, e]).permutation(len(source))`` (the windows in
    file order with ``shuffle=False``); batches run on across the end of an epoch, so no
    window is dropped. Row ``r`` of batch ``s`` is always that sequence's example
    ``s * batch_size + r``, whatever the processes, devices or strategy: batch ``s`` is a
    pure function of ``s``, the seed and the file. So the iterator's state *is* the step,
    which every checkpoint holds: a run restarted from a checkpoint (after a SIGKILL, on
    another device count, another strategy, or fewer processes) trains on exactly the
    batches an uninterrupted run trains on from that step.

    With ``sharding`` (``trainer.batch_sharding``), each process reads only the rows its
    devices hold (:func:`jax.make_array_from_process_local_data` places them), and
    iteration yields global ``jax.Array`` batches the Trainer uses as they are; without,
    each process reads whole global batches as NumPy arrays (one process, or a small
    corpus). Reading runs ahead in grain's threads (``prefetch`` batches).

    :meth:`Trainer.fit` iterates from ``state.step`` (:meth:`iter_from`, endless);
    ``iter(batches)`` gives the first ``len(batches)`` (one epoch's worth, e.g. for
    :class:`~jaxcoll.dp.Evaluate`); ``batches[s]`` is global batch ``s`` whole, as NumPy.

    Args:
        source: the windows (:class:`TokenWindows`), or any grain data source whose
            examples are dicts of NumPy arrays.
        batch_size: examples in one global batch (a multiple of the devices the batch is
            split over).
        seed: the shuffle's seed.
        shuffle: a new permutation of the windows each epoch; False: in file order.
        sharding: where a global batch goes (``trainer.batch_sharding``, split along the
            leading dim); None: whole NumPy batches on the host.
        prefetch: batches read ahead of the one in use (grain's prefetch buffer); 0: read
            each when asked for.
        threads: threads reading batches ahead (grain's ``ReadOptions.num_threads``).

    Example (8 devices)::

        >>> np.arange(1000, dtype=np.uint16).tofile("tokens.bin")
        >>> trainer = dp.Trainer(loss_fn, optax.adam(1e-3))
        >>> data = dp.TokenBatches(dp.TokenWindows("tokens.bin", 8), batch_size=16,
        ...                        sharding=trainer.batch_sharding)
        >>> state, history = trainer.fit(state, data, steps=10)
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        sharding: Sharding | None = None,
        prefetch: int = 2,
        threads: int = 1,
    ) -> None:
        api = "TokenBatches"
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(
                f"{api}: source must be a grain data source with len() and [i] (e.g. "
                f"dp.TokenWindows(path, block_size)), got {type(source).__name__} instead."
            )
        if len(source) < 1:
            raise ValueError(f"{api}: source has no example; pass a non-empty source.")
        self.source = source
        self.batch_size = check_static_int(api, "batch_size", batch_size)
        if self.batch_size < 1:
            raise ValueError(f"{api}: batch_size={batch_size} must be at least 1.")
        self.seed = check_static_int(api, "seed", seed)
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"{api}: seed={seed} must be a non-negative int.")
        self.shuffle = bool(shuffle)
        if sharding is not None and not isinstance(sharding, Sharding):
            raise TypeError(
                f"{api}: sharding must be a jax.sharding.Sharding (trainer.batch_sharding) "
                f"or None, got {type(sharding).__name__} instead."
            )
        self.sharding = sharding
        for name, value in (("prefetch", prefetch), ("threads", threads)):
            if check_static_int(api, name, value) < 0:
                raise ValueError(f"{api}: {name}={value} must be 0 or more.")
        self.prefetch, self.threads = int(prefetch), int(threads)
        self.rows = np.arange(self.batch_size)
        if sharding is not None:
            try:
                self.rows = process_rows(sharding, self.batch_size)
            except ValueError as e:  # jax: the batch does not split over the devices
                raise ValueError(
                    f"{api}: batch_size={batch_size} does not split evenly over the "
                    f"sharding's devices; pass a multiple of the number of devices the batch "
                    f"is split over (the Trainer's n)."
                ) from e
        self._order = _Order(source, self.seed, self.shuffle)

    def __len__(self) -> int:
        """Batches per epoch (``len(source) // batch_size``): what ``fit(epochs=)`` counts."""
        return max(1, len(self.source) // self.batch_size)

    def ids(self, step: int) -> np.ndarray:
        """The windows of global batch ``step``, row by row (``batches[step]["id"]`` for
        :class:`TokenWindows`), computed without reading the file."""
        g = int(step) * self.batch_size
        return np.array([self._order.window(k) for k in range(g, g + self.batch_size)], np.int64)

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        """Global batch ``step``, whole, as NumPy arrays (any process may read it)."""
        step = check_static_int("TokenBatches[step]", "step", step)
        if step < 0:
            raise IndexError(f"TokenBatches: step {step} is negative.")
        g = step * self.batch_size
        return _stack([self._order(k) for k in range(g, g + self.batch_size)])

    def dataset(self) -> grain.MapDataset:
        """This process's batches as a grain ``MapDataset``: element ``s`` is this process's
        rows of global batch ``s`` (``self.rows``), NumPy, not placed."""
        # grain (and the C++ modules it loads, array_record's) only where a pipeline is
        # built: importing jaxcoll.dp does not load it.
        import grain

        local = len(self.rows)
        steps = sys.maxsize // (2 * self.batch_size)  # endless: epochs repeat
        return (
            grain.MapDataset.range(steps * local)
            .map(_Rows(self.batch_size, self.rows))
            .map(self._order)
            .batch(local, drop_remainder=True)
        )

    def iter_from(self, step: int = 0) -> grain.DatasetIterator:
        """grain's iterator over the batches from global batch ``step`` on, each placed
        (with ``sharding``) as a global ``jax.Array`` batch.

        Its ``get_state()`` is ``{"next_index": s}``, ``s`` the step of the batch it yields
        next, and ``set_state({"next_index": s})`` moves it to step ``s``: the state is the
        step, which a checkpoint of the training state already holds.

        Example::

            >>> it = data.iter_from(5)
            >>> batch = next(it)                     # global batch 5
            >>> it.get_state()
            {'next_index': 6}
        """
        import grain  # as in dataset()

        step = check_static_int("TokenBatches.iter_from", "step", step)
        if step < 0:
            raise ValueError(f"TokenBatches.iter_from: step={step} must be 0 or more.")
        ds: Any = self.dataset().to_iter_dataset(
            grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=self.prefetch)
        )
        if self.sharding is not None:
            ds = ds.map(self._place)
        iterator = iter(ds)
        if step:
            iterator.set_state({"next_index": step})
        return iterator

    def __iter__(self) -> Iterator[Any]:
        """The first ``len(self)`` batches (one epoch's worth: an evaluation set, say);
        :meth:`iter_from` goes on for ever, as :meth:`Trainer.fit` reads it."""
        return itertools.islice(self.iter_from(0), len(self))

    def _place(self, local: dict[str, np.ndarray]) -> Any:
        assert self.sharding is not None
        return {
            k: jax.make_array_from_process_local_data(
                self.sharding, v, (self.batch_size, *np.shape(v)[1:])
            )
            for k, v in local.items()
        }

    def __repr__(self) -> str:
        return (
            f"TokenBatches({self.source!r}, batch_size={self.batch_size}, seed={self.seed}, "
            f"shuffle={self.shuffle})"
        )


def _stack(examples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}
