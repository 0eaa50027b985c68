"""Host-level helpers: send picklable Python objects between processes."""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from .._core.checks import check_rank


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Every process gets process ``src``'s ``obj`` (any picklable object).

    ``torch.distributed.broadcast_object_list([obj], src)``, returning the object instead of
    filling a list. ``src`` is a process index (``jax.process_index()``), not a device rank.
    With one process it returns ``obj`` at once. Otherwise: pickle on ``src``, then two
    ``multihost_utils.broadcast_one_to_all`` calls (the byte count, then the bytes). Every
    process must call it.

    .. warning::
        Every other process runs ``pickle.loads`` on the bytes process ``src`` sends, and
        unpickling runs code chosen by whoever wrote those bytes. As with
        ``torch.distributed.broadcast_object_list``, use it only in a job whose processes and
        network you trust (the coordinator has no authentication; see README "Running on
        several hosts"); send arrays or plain data otherwise.

    Example (one process)::

        >>> dist.broadcast_object({"lr": 0.1})
        {'lr': 0.1}
    """
    api = "dist.broadcast_object"
    count = jax.process_count()
    src = check_rank(api, "src", src, count)
    if count == 1:
        return obj
    is_source = jax.process_index() == src
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if is_source else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(payload.size), is_source=is_source))
    buf = payload if is_source else np.zeros(size, np.uint8)
    data = multihost_utils.broadcast_one_to_all(buf, is_source=is_source)
    return obj if is_source else pickle.loads(np.asarray(data).tobytes())


def all_gather_object(obj: Any) -> list[Any]:
    """Every process gets the list of every process's ``obj``, in process order.

    ``torch.distributed.all_gather_object(object_list, obj)``, returning the list. With one
    process it returns ``[obj]`` at once. Otherwise: pickle, ``multihost_utils.process_allgather``
    of the byte counts, then of the bytes padded to the longest. Every process must call it.

    .. warning::
        Every process runs ``pickle.loads`` on the bytes each other process sends, and
        unpickling runs code chosen by whoever wrote those bytes. As with
        ``torch.distributed.all_gather_object``, use it only in a job whose processes and
        network you trust (the coordinator has no authentication; see README "Running on
        several hosts"); gather arrays or plain data otherwise.

    Example (one process)::

        >>> dist.all_gather_object("hello")
        ['hello']
    """
    if jax.process_count() == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(payload.size))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: payload.size] = payload
    data = np.asarray(multihost_utils.process_allgather(buf))
    return [pickle.loads(data[i, : int(n)].tobytes()) for i, n in enumerate(sizes)]
