"""Timing: the median of waited-for runs, the allocator setting and the memory-copy ceiling."""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

import jax
import numpy as np


def malloc_tune() -> bool:
    """Keep freed memory in glibc's heap instead of returning it to the OS (mmap/munmap).

    XLA on CPU allocates a fresh buffer per op; with glibc's defaults, every buffer above the
    mmap threshold is a new mapping whose pages fault in on first touch. Measured here that
    doubles the time of large collectives (see docs/benchmarks.md). Returns whether it applied.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        m_trim, m_top_pad, m_mmap = -1, -2, -3
        ok = libc.mallopt(m_mmap, 1 << 30) and libc.mallopt(m_trim, 1 << 31)
        return bool(ok and libc.mallopt(m_top_pad, 256 << 20))
    except (OSError, AttributeError):
        return False


def memcpy_gbps(nbytes: int = 64 << 20, iters: int = 7) -> float:
    """Median copy bandwidth of one core, counting read + write, in GB/s."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(times)) / 1e9


def median_time(
    f: Callable[[jax.Array], jax.Array], x: jax.Array, iters: int, warmup: int
) -> tuple[float, jax.Array]:
    """Run ``f(x)`` ``max(1, warmup)`` times untimed, then ``iters`` times, waiting for each.

    Returns:
        The median time in seconds on this process, and the last output.
    """
    out = f(x)
    out.block_until_ready()
    for _ in range(max(1, warmup) - 1):
        out = f(x)
        out.block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        out = f(x)
        out.block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out
