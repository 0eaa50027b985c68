"""Shared test helpers: meshes over the simulated devices and running a body per rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def mesh_1d(n: int, name: str = "x") -> Mesh:
    """A 1-D mesh over the first ``n`` simulated devices."""
    return Mesh(np.array(jax.devices()[:n]), (name,))


def mesh_2d(outer: int = 2, inner: int = 4) -> Mesh:
    """A (node, local) mesh over the first outer*inner devices."""
    return Mesh(np.array(jax.devices()[: outer * inner]).reshape(outer, inner), ("node", "local"))


def run_per_rank(
    body: Callable, mesh: Mesh, inputs: Sequence[np.ndarray], *, jit: bool = False
):
    """Run ``body`` under shard_map with ``inputs[k]`` holding one row per rank.

    Each input has a leading axis of size n (the mesh size); rank r sees row r (without the
    leading axis). ``body`` returns a pytree of per-rank arrays; the result has a leading axis
    of size n again, as NumPy arrays.
    """
    names = tuple(mesh.axis_names)
    spec = P(names if len(names) > 1 else names[0])

    def wrapped(*xs):
        out = body(*[x[0] for x in xs])
        return jax.tree_util.tree_map(lambda y: y[None], out)

    f = jax.shard_map(wrapped, mesh=mesh, in_specs=(spec,) * len(inputs), out_specs=spec)
    if jit:
        f = jax.jit(f)
    placed = [jax.device_put(np.asarray(x), NamedSharding(mesh, spec)) for x in inputs]
    return jax.tree_util.tree_map(np.asarray, f(*placed))
