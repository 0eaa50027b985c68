"""Shared test helpers: meshes over the simulated devices and running a body per rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def mesh_1d(n: int, name: str = "x") -> Mesh:
    """A 1-D mesh over the first ``n`` simulated devices."""
    return Mesh(np.array(jax.devices()[:n]), (name,))


def mesh_2d(outer: int = 2, inner: int = 4) -> Mesh:
    """A (node, local) mesh over the first outer*inner devices."""
    return Mesh(np.array(jax.devices()[: outer * inner]).reshape(outer, inner), ("node", "local"))


def run_per_rank(body: Callable, mesh: Mesh, inputs: Sequence[np.ndarray], *, jit: bool = False):
    """Run ``body`` under shard_map with ``inputs[k]`` holding one row per rank.

    Each input has a leading axis of size n (the mesh size); rank r sees row r (without the
    leading axis). ``body`` returns a pytree of per-rank arrays; the result has a leading axis
    of size n again, as NumPy arrays. Rows travel as contiguous blocks of one global array, so
    the program has no extra per-rank reshapes (eager shard_map compiles every op it runs).
    """
    names = tuple(mesh.axis_names)
    spec = P(names if len(names) > 1 else names[0])
    n = mesh.devices.size
    scalar_in = [np.ndim(x) == 1 for x in inputs]
    scalar_out = {}

    def wrapped(*xs):
        xs = [x[0] if s else x for x, s in zip(xs, scalar_in)]
        out = body(*xs)
        leaves, treedef = jax.tree_util.tree_flatten(out)
        scalar_out["flags"] = [jnp.ndim(y) == 0 for y in leaves]
        scalar_out["tree"] = treedef
        return [y[None] if jnp.ndim(y) == 0 else y for y in leaves]

    f = jax.shard_map(wrapped, mesh=mesh, in_specs=(spec,) * len(inputs), out_specs=spec)
    if jit:
        f = jax.jit(f)
    placed = []
    for x, s in zip(inputs, scalar_in):
        x = np.asarray(x)
        glob = x if s else x.reshape((n * x.shape[1],) + x.shape[2:])
        placed.append(jax.device_put(glob, NamedSharding(mesh, spec)))
    outs = f(*placed)
    res = []
    for y, s in zip(outs, scalar_out["flags"]):
        y = np.asarray(y)
        res.append(y if s else y.reshape((n, y.shape[0] // n) + y.shape[1:]))
    return jax.tree_util.tree_unflatten(scalar_out["tree"], res)


def bind(binding: str, body: Callable, n: int = 4, axis: str = "i") -> Callable:
    """``body`` (per-rank values -> per-rank values) over stacked inputs ``(n, ...)``, with the
    axis bound by ``binding``: ``shard_map``, ``pmap`` or ``vmap``, each ``_jit`` or not."""
    kind, jitted = binding.removesuffix("_jit"), binding.endswith("_jit")
    if kind == "vmap":
        f = jax.vmap(body, axis_name=axis)
    elif kind == "pmap":
        f = jax.pmap(body, axis_name=axis, devices=jax.devices()[:n])
    else:
        mesh = mesh_1d(n, axis)
        mapped = jax.shard_map(
            lambda *a: jax.tree.map(lambda y: y[None], body(*(v[0] for v in a))),
            mesh=mesh,
            in_specs=P(axis),
            out_specs=P(axis),
        )

        def f(*args):
            return mapped(*(jax.device_put(a, NamedSharding(mesh, P(axis))) for a in args))

    return jax.jit(f) if jitted and kind != "pmap" else f
