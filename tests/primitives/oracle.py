"""NumPy reference for every primitive: given the inputs of a group's ranks, each rank's output.

Everything here is written from the documented semantics with NumPy only (no jax), so the tests
compare jaxcoll against an independent implementation.
"""

from __future__ import annotations

import functools

import numpy as np

WIDE = {"bool": np.bool_, "integer": None, "floating": np.float64, "complex": np.complex128}


def kind_of(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "bool"
    if np.issubdtype(dtype, np.integer):
        return "integer"
    if np.issubdtype(dtype, np.complexfloating):
        return "complex"
    return "floating"  # float16/32/64 and ml_dtypes' bfloat16


def widen(a: np.ndarray) -> np.ndarray:
    """Floats to float64 and complex to complex128 (exact); ints and bools as they are."""
    wide = WIDE[kind_of(a.dtype)]
    return a if wide is None else a.astype(wide)


def fold(op: str, xs: list[np.ndarray]) -> np.ndarray:
    """op over the ranks' arrays (already widened), in rank order, with torch's bool rules."""
    kind = kind_of(xs[0].dtype)
    if kind == "bool":
        table = {
            "sum": np.logical_or,
            "max": np.logical_or,
            "bor": np.logical_or,
            "product": np.logical_and,
            "min": np.logical_and,
            "band": np.logical_and,
            "bxor": np.logical_xor,
        }
        return functools.reduce(table[op], xs)
    if op == "avg":
        return functools.reduce(np.add, xs) / len(xs)
    table = {
        "sum": np.add,
        "product": np.multiply,
        "min": np.minimum,
        "max": np.maximum,
        "band": np.bitwise_and,
        "bor": np.bitwise_or,
        "bxor": np.bitwise_xor,
    }
    with np.errstate(over="ignore"):
        return functools.reduce(table[op], xs)


def chunks(a: np.ndarray, n: int) -> list[np.ndarray]:
    return np.split(a, n, axis=0)


# Each oracle takes the list of the group's inputs (rank order) and returns one output per rank.


def all_reduce(xs, op):
    out = fold(op, [widen(x) for x in xs])
    return [out] * len(xs)


def reduce(xs, op, dst):
    total = fold(op, [widen(x) for x in xs])
    return [total if r == dst else widen(x) for r, x in enumerate(xs)]


def broadcast(xs, src):
    return [xs[src]] * len(xs)


def all_gather(xs, tiled):
    out = np.concatenate(xs, 0) if tiled else np.stack(xs, 0)
    return [out] * len(xs)


def gather(xs, dst):
    g = np.stack(xs, 0)
    return [g if r == dst else np.zeros_like(g) for r in range(len(xs))]


def scatter(xs, src, tiled):
    n = len(xs)
    parts = chunks(xs[src], n) if tiled else list(xs[src])
    return [parts[r] for r in range(n)]


def reduce_scatter(xs, op, tiled):
    n = len(xs)
    total = fold(op, [widen(x) for x in xs])
    parts = chunks(total, n) if tiled else list(total)
    return [parts[r] for r in range(n)]


def all_to_all_tiled(xs):
    n = len(xs)
    return [np.concatenate([chunks(x, n)[r] for x in xs], 0) for r in range(n)]


def all_to_all_untiled(xs, split_dim, concat_dim):
    n = len(xs)
    return [np.stack([np.take(x, r, axis=split_dim) for x in xs], concat_dim) for r in range(n)]


def sendrecv(xs, pairs):
    senders = {d: s for s, d in pairs}
    return [xs[senders[r]] if r in senders else xs[r] for r in range(len(xs))]


def shift(xs, offset):
    n = len(xs)
    return [xs[(r - offset) % n] for r in range(n)]


# ---- uneven collectives and prefix reductions (issue 14)


def ragged_all_to_all(xs, sizes, out_size):
    """xs[j]: rank j's (m, *s) buffer; sizes[j][r]: rows rank j sends to rank r (front first,
    negative as 0, clipped to m). Returns per rank (out, recv_sizes), out packed in sender
    order, rows past out_size dropped."""
    n, m = len(xs), xs[0].shape[0]
    parts = []  # parts[j][r]: the rows rank j sends to rank r
    for j in range(n):
        start, row = 0, []
        for r in range(n):
            k = min(max(int(sizes[j][r]), 0), m - start)
            row.append(xs[j][start : start + k])
            start += k
        parts.append(row)
    outs = []
    for r in range(n):
        out = np.zeros((out_size, *xs[0].shape[1:]), xs[0].dtype)
        pos, recv = 0, []
        for j in range(n):
            k = min(len(parts[j][r]), out_size - pos)
            out[pos : pos + k] = parts[j][r][:k]
            recv.append(k)
            pos += k
        outs.append((out, np.array(recv, np.int32)))
    return outs


def all_gather_uneven(xs, sizes):
    cap = xs[0].shape[0]
    sizes = np.clip(np.asarray(sizes), 0, cap).astype(np.int32)
    padded = np.stack(
        [
            np.where(
                (np.arange(cap) < s).reshape((cap,) + (1,) * (x.ndim - 1)), x, np.zeros((), x.dtype)
            )
            for x, s in zip(xs, sizes)
        ]
    )
    return [(padded, sizes)] * len(xs)


def gather_uneven(xs, sizes, dst):
    padded, s = all_gather_uneven(xs, sizes)[0]
    return [
        (padded, s) if r == dst else (np.zeros_like(padded), np.zeros_like(s))
        for r in range(len(xs))
    ]


def identity(op, dtype):
    """What an empty reduction gives (exscan's rank 0), written out per op and dtype."""
    dtype = np.dtype(dtype)
    kind = kind_of(dtype)
    if kind == "bool":
        return np.bool_(op in ("product", "min", "band"))
    if op == "min":
        return np.inf if kind == "floating" else np.iinfo(dtype).max
    if op == "max":
        return -np.inf if kind == "floating" else np.iinfo(dtype).min
    if op == "product":
        return 1
    if op == "band":
        return ~np.zeros((), dtype)  # every bit set
    return 0


def scan(xs, op):
    return [fold(op, [widen(x) for x in xs[: r + 1]]) for r in range(len(xs))]


def exscan(xs, op):
    out = []
    for r in range(len(xs)):
        if r == 0:
            e = identity(op, xs[0].dtype)
            out.append(np.full(xs[0].shape, e, widen(xs[0]).dtype))
        else:
            out.append(fold(op, [widen(x) for x in xs[:r]]))
    return out


def reduce_scatter_uneven(xs, op, sizes):
    """xs[j]: rank j's input, the n parts concatenated (sum(sizes) rows). Returns per rank r
    (op over the ranks of part r, zero-padded to max(sizes) rows; sizes[r])."""
    total = fold(op, [widen(x) for x in xs])
    cap = max(sizes)
    starts = np.cumsum([0, *sizes])
    out = []
    for r, k in enumerate(sizes):
        part = np.zeros((cap, *total.shape[1:]), total.dtype)
        part[:k] = total[starts[r] : starts[r] + k]
        out.append((part, np.int32(k)))
    return out
