"""Host copies of train-state trees, whole, in single- and multi-process jobs alike.

``jax.device_get`` reads an array only from devices this process can address; in a
multi-process job a leaf split over every process's devices (``dp.sync.FSDP``) spans devices
it cannot, and raises. :func:`to_host` gathers such leaves with
``jax.experimental.multihost_utils.process_allgather`` (a collective over every process)
and reads the others locally.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from .._core.typing import PyTree


def to_host(tree: PyTree) -> PyTree:
    """Every leaf of ``tree`` as a whole NumPy array on this process's host.

    Collective in a multi-process job when a leaf spans other processes' devices: every
    process must call it with the same tree (each leaf's sharding is the same everywhere, so
    every process gathers the same leaves, in the same order).
    """

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            # Params cross processes here: an all-gather onto every device of the mesh.
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map(one, tree)
