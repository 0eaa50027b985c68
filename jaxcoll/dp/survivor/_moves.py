"""Moving a :class:`~jaxcoll.dp.Survivor`'s state and batches onto a new mesh: each process
from its own shards, the mesh published for a replacement, the first replica's copy sent to all.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..._core.roles import Role
from ..._core.typing import PyTree
from ..._jax import distributed_state
from ..state import TrainState


def _local_int(x: Any) -> int:
    """A replicated scalar's value from this process's first shard (no collective)."""
    if isinstance(x, jax.Array):
        return int(np.asarray(x.addressable_shards[0].data))
    return int(x)


def _placed(path: Any, x: Any, mesh: Mesh) -> Any:
    """``x`` on ``mesh`` (same spec), from this process's shards of it."""
    if not isinstance(x, jax.Array):
        return x
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
    full = np.zeros(x.shape, x.dtype)
    have = np.zeros(x.shape, bool)
    for shard in x.addressable_shards:
        full[shard.index] = np.asarray(shard.data)
        have[shard.index] = True

    def part(index: Any) -> np.ndarray:
        if not have[index].all():
            raise RuntimeError(
                f"dp.Survivor.step: state leaf {jax.tree_util.keystr(path)} is not whole on "
                f"this process's replica (split over the replicate axis: per-rank hook "
                f"state?); the lost replica took its part. Use a strategy whose state is "
                f"replicated over the replicas."
            )
        return full[index]

    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), part)


_MESH_KEY = "jaxcoll/survivor/mesh"


def _publish(mesh: Mesh) -> None:
    """Put the mesh's device ids (its replica blocks, in order) in the job's key-value store,
    for a replacement's :meth:`Survivor.join`."""

    client = distributed_state().client
    if client is None:
        return
    blocks = np.moveaxis(mesh.devices, mesh.axis_names.index(Role.REPLICATE.value), 0)
    value = json.dumps([[d.id for d in b.flat] for b in blocks])
    client.key_value_set(_MESH_KEY, value, allow_overwrite=True)


def _published(full: Mesh, timeout: float) -> np.ndarray:
    """The survivors' current replica blocks, from the key-value store."""

    client = distributed_state().client
    try:
        rows = json.loads(client.blocking_key_value_get(_MESH_KEY, int(timeout * 1000)))
    except Exception as e:  # XLA's status error: no survivor lost a replica in this job
        raise RuntimeError(
            f"dp.Survivor.join: no survivor published its mesh within {timeout} s (key "
            f"{_MESH_KEY!r}): join only a job whose dp.Survivor lost this replica. "
            f"{type(e).__name__}: {e}"
        ) from e
    by_id = {d.id: d for d in full.devices.flat}
    block = np.moveaxis(full.devices, full.axis_names.index(Role.REPLICATE.value), 0)[0]
    return np.stack([np.array([by_id[i] for i in row]).reshape(block.shape) for row in rows])


def _zeros_on(x: Any, mesh: Mesh) -> Any:
    """An array shaped like ``x`` (same spec) on ``mesh``, zeros on this process's devices."""
    if not isinstance(x, jax.Array):
        return x
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
    zeros = np.zeros(x.shape, x.dtype)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: zeros[i])


def _from_first_replica(state: TrainState, mesh: Mesh) -> TrainState:
    """``state`` with every replica holding the first replica's copy (one collective)."""
    import jax.numpy as jnp

    leaves, tree = jax.tree_util.tree_flatten(state)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    specs = tuple(leaves[i].sharding.spec for i in arrays)
    axis = Role.REPLICATE.value

    def body(*xs: jax.Array) -> tuple[jax.Array, ...]:
        first = jax.lax.axis_index(axis) == 0
        return tuple(jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axis) for x in xs)

    sent = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))(
        *(leaves[i] for i in arrays)
    )
    for i, x in zip(arrays, jax.block_until_ready(sent)):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(tree, leaves)


def _global(batch: PyTree, sharding: NamedSharding) -> PyTree:
    """A host global batch (the same on every process) as global arrays placed as
    ``sharding``, each process giving its devices' rows: no cross-process check (``jax.
    device_put``'s runs a collective over one device per process, in an order a dead process
    used too, which a replacement cannot join)."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return x
        x = np.asarray(x)
        if x.ndim == 0:
            return x
        return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

    return jax.tree_util.tree_map(one, batch)
