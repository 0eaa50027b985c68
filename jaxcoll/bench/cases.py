"""One benchmark case per op: the jitted ``shard_map`` program, its input and a NumPy oracle.

Every rank's input is small integers (``arange % 7`` plus ``rank % 5``): sums are exact in
every float dtype, so a wrong element is a real error, never rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C


@dataclass(frozen=True)
class OpSpec:
    """How one op is benchmarked.

    Attributes:
        body: ``body(v, axis, algorithm, root)``, the op on one rank's buffer.
        want: ``want(rows, r, root)``, rank r's expected output from every rank's input
            ``rows`` (shape ``(n, count)``).
        busbw: nccl-tests' bus-bandwidth factor for ``n`` ranks.
    """

    body: Callable[[jax.Array, Any, str, int], jax.Array]
    want: Callable[[np.ndarray, int, int], np.ndarray]
    busbw: Callable[[int], float]


def _total(rows: np.ndarray) -> np.ndarray:
    return rows.sum(0, dtype=np.float64)


def _scattered(rows: np.ndarray, r: int, root: int) -> np.ndarray:
    m = rows.shape[1] // rows.shape[0]
    return _total(rows)[r * m : (r + 1) * m]


# In the order ``--ops all`` runs them.
SPECS: dict[str, OpSpec] = {
    "all_reduce": OpSpec(
        lambda v, axis, alg, root: C.all_reduce(v, axis, algorithm=alg),
        lambda rows, r, root: _total(rows),
        lambda n: 2 * (n - 1) / n,
    ),
    "all_gather": OpSpec(
        lambda v, axis, alg, root: C.all_gather(v, axis, tiled=True, algorithm=alg),
        lambda rows, r, root: rows.reshape(-1),
        lambda n: (n - 1) / n,
    ),
    "reduce_scatter": OpSpec(  # count is the per-rank input: n slices of count / n
        lambda v, axis, alg, root: C.reduce_scatter(v, axis, tiled=True, algorithm=alg),
        _scattered,
        lambda n: (n - 1) / n,
    ),
    "broadcast": OpSpec(
        lambda v, axis, alg, root: C.broadcast(v, axis, root, algorithm=alg),
        lambda rows, r, root: rows[root],
        lambda n: 1.0,
    ),
    "reduce": OpSpec(
        lambda v, axis, alg, root: C.reduce(v, axis, root, algorithm=alg),
        lambda rows, r, root: _total(rows) if r == root else rows[r],
        lambda n: 1.0,
    ),
}
OPS = tuple(SPECS)


def counts(op: str, nbytes: int, n: int, itemsize: int) -> tuple[int, int]:
    """``(elements per rank in the input, elements as nccl-tests counts them)`` for a row of
    ``nbytes``: the per-rank buffer for all_reduce, broadcast and reduce, the gathered output
    for all_gather and the input (a multiple of n) for reduce_scatter; at least n elements."""
    count = max(n, nbytes // itemsize)
    if op == "all_gather":
        return count // n, count // n * n
    if op == "reduce_scatter":
        count = count // n * n
    return count, count


@dataclass(frozen=True)
class Case:
    """One row of the benchmark, ready to run."""

    op: str
    algorithm: str
    fn: Callable[[jax.Array], jax.Array]
    x: jax.Array
    rows: np.ndarray
    count: int
    devices: int

    @property
    def nbytes(self) -> int:
        return self.count * self.rows.dtype.itemsize

    def wrong(self, out: jax.Array) -> int:
        """Elements of this process's shards of ``out`` that differ from the oracle."""
        spec, root = SPECS[self.op], self.devices - 1
        bad = 0
        for shard in out.addressable_shards:
            r = shard.index[0].start or 0
            got = np.asarray(shard.data)[0].astype(np.float64)
            bad += int(np.sum(got != np.asarray(spec.want(self.rows, r, root), np.float64)))
        return bad

    def row(self, seconds: float, wrong: int) -> dict:
        """The result row: time, algbw = size / time and busbw = algbw * factor (GB/s)."""
        algbw = self.nbytes / seconds / 1e9
        return {
            "op": self.op,
            "algorithm": self.algorithm,
            "bytes": self.nbytes,
            "count": self.count,
            "dtype": self.rows.dtype.name,
            "time_us": seconds * 1e6,
            "algbw": algbw,
            "busbw": algbw * SPECS[self.op].busbw(self.devices),
            "wrong": wrong,
            "devices": self.devices,
        }


def build(mesh: Mesh, axis: Any, op: str, algorithm: str, nbytes: int, dtype: np.dtype) -> Case:
    """The case for ``op`` with ``algorithm`` on a row of ``nbytes`` (see :func:`counts`),
    the root of broadcast and reduce being the last rank."""
    n = mesh.devices.size
    per_rank, count = counts(op, nbytes, n, dtype.itemsize)
    base = (np.arange(per_rank) % 7).astype(dtype)
    rows = np.stack([base + np.asarray(r % 5, dtype) for r in range(n)])
    body, root, spec = SPECS[op].body, n - 1, P(axis)
    fn = jax.jit(
        jax.shard_map(
            lambda v: body(v[0], axis, algorithm, root)[None],
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )
    x = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, spec), lambda i: rows[i])
    return Case(op, algorithm, fn, x, rows, count, n)
