"""A bound on the eager collectives in flight: a loop of ``dist`` calls never hangs on its own.

Every ``dist`` call only dispatches its program and returns (as torch's NCCL calls do), so a
loop of them queues programs faster than the devices run them. XLA:CPU (jaxlib 0.10, simulated
devices) deadlocks once about 34 or more collective programs are queued with none waited for:
the oldest one's rendezvous never fills, and the process hangs for ever (measured: the
120-call ``all_reduce`` loop of 1M floats on 8 devices hung in 4 of 4 runs, from 38 queued
calls; 33 or fewer never hung; plain ``jax.jit`` + ``shard_map`` loops hang the same way).

So :func:`admit` keeps the first output of each of the newest dispatched calls, and once
:func:`limit` of them are running, waits for the oldest before the call returns: at most that
many are ever in flight. Outputs that are already computed are dropped at every call, so a
loop that waits on its results (or whose devices keep up) never waits here. The limit:

* XLA:CPU with fewer than two cores per device (the deadlock's condition: 8 simulated devices
  hung without a bound on 2, 4 and 8 cores, jaxlib 0.10.2 and 0.11.2, and never on 16 cores,
  even over 1000 calls): :data:`CPU_LIMIT` (8). On 2 busy cores, 33 in flight hung 3 of 3
  runs of the loop above and 32 or fewer none of 5; 2 to 8 are the fastest (3.7-4.7 ms a
  call against 5.6-6.5 ms for 16 to 32: ``benchmarks/eager_inflight.py``), and 8 is a
  quarter of the queue that deadlocks;
* otherwise (XLA:CPU with cores to spare, GPU, TPU): :data:`OTHER_LIMIT` (256). No deadlock of
  a queue is known there (on 16 cores the loop ran 2.3x faster unbounded than with 8; XLA:GPU
  runs each device's programs in order on its stream); the bound only caps how many results
  a runaway loop keeps alive;
* ``JAXCOLL_MAX_INFLIGHT=N`` sets it everywhere (0: no bound).

The kept outputs are the caller's own result arrays, held until they are computed (with 8
calls of a 32 MB result, at most 256 MB beyond what the loop itself holds).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import jax

CPU_LIMIT = 8
"""Eager collectives that may be in flight at once on XLA:CPU with fewer than two cores per
device (``JAXCOLL_MAX_INFLIGHT``)."""
OTHER_LIMIT = 256
"""The same elsewhere (GPU, TPU, XLA:CPU with cores to spare), where only memory asks for a
bound."""

_queue: collections.deque = collections.deque()
_limit: int | None = None  # settled at the first call, from the environment or the backend


def limit(platform: str, devices: int = 1, cores: int | None = None) -> int:
    """The bound (0: none) for ``devices`` local devices of ``platform`` on ``cores`` cores
    (default: the cores this process may run on): ``JAXCOLL_MAX_INFLIGHT``, else
    :data:`CPU_LIMIT` for XLA:CPU with fewer than two cores per device, else
    :data:`OTHER_LIMIT`."""
    raw = os.environ.get("JAXCOLL_MAX_INFLIGHT", "").strip()
    if not raw:
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        starved = platform == "cpu" and cores < 2 * devices
        return CPU_LIMIT if starved else OTHER_LIMIT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"jaxcoll.distributed: JAXCOLL_MAX_INFLIGHT={raw!r} is not a count of calls. Set "
            f"it to e.g. {CPU_LIMIT} (the most eager collectives queued at once), or 0 for no "
            f"bound."
        )
    return value


def _ready(leaf: Any) -> bool:
    try:
        return leaf.is_deleted() or bool(leaf.is_ready())  # a deleted array is not ours to wait for
    except Exception:  # noqa: BLE001 - donated or otherwise gone
        return True


def admit(outputs: Any) -> None:
    """Count ``outputs`` (a pytree of ``jax.Array``, just dispatched) as in flight; while the
    limit is reached, wait for the oldest, so that the next dispatch stays within it."""
    global _limit
    leaf = outputs if isinstance(outputs, jax.Array) else _first(outputs)
    if leaf is None:
        return
    if _limit is None:
        platform = next(iter(leaf.sharding.device_set)).platform
        _limit = limit(platform, len(jax.local_devices(backend=platform)))
    if not _limit:
        return
    queue = _queue
    queue.append(leaf)
    while queue and _ready(queue[0]):  # calls complete in order: drop the finished ones
        queue.popleft()
    while len(queue) >= _limit:
        oldest = queue.popleft()
        if not _ready(oldest):
            oldest.block_until_ready()


def in_flight() -> int:
    """How many admitted calls may still be running (those not yet seen finished)."""
    return len(_queue)


def reset() -> None:
    """Forget the queue and read the limit again at the next call (tests)."""
    global _limit
    _queue.clear()
    _limit = None


def _first(tree: Any) -> Any:
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            return leaf
    return None
