"""The first TrainState on the mesh (``Trainer.init``): the params and the model state copied
and placed as the strategy holds them (rank 0's copy on every rank with ``per_rank``), the
optimizer, extra and hook state built in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ... import primitives
from ..._core.typing import PyTree
from ..extra import Extra
from ..state import TrainState
from ..sync import Strategy


def first_state(
    sync: Strategy,
    params: PyTree,
    rng: jax.Array,
    model_state: PyTree | None,
    *,
    per_rank: bool,
    extra: Extra | None,
    model_axes: tuple,
) -> TrainState:
    """The TrainState at step 0 of ``params`` (unboxed, floating: checked by the caller)
    under the bound strategy ``sync`` (see ``Trainer.init``)."""
    model_state = {} if model_state is None else model_state
    if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    rng = jnp.asarray(rng, jnp.uint32)
    if rng.shape != (2,):
        raise ValueError(
            f"Trainer.init: rng must be a PRNG key, e.g. jax.random.key(0), got "
            f"an array of shape {rng.shape} instead."
        )
    replicated = NamedSharding(sync.mesh, P())
    if per_rank:
        params, model_state = _broadcast_from_rank0(sync, (params, model_state))
    placed = sync.named(sync.state_param_specs(params))
    # A copy: the step donates the state's buffers, and the caller's arrays must survive.
    copy = jax.jit(
        lambda t: jax.tree_util.tree_map(jnp.copy, t), out_shardings=(placed, replicated)
    )
    params, model_state = copy((params, model_state))
    opt_state = sync.init(params)
    extras = {}
    if extra is not None:
        shapes = jax.eval_shape(extra.init, params)
        extras = jax.jit(extra.init, out_shardings=sync.named(sync.extra_specs(shapes, params)))(
            params
        )
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    comm_state = sync.init_comm(params)
    if model_axes and jax.tree_util.tree_leaves(comm_state):
        raise ValueError(
            f"Trainer.init: hook={sync.hook!r} keeps a per-rank state shaped like whole "
            f"gradients, and with the layout's axes {model_axes} each device's "
            f"gradients are slices of them. Use a stateless hook (None or "
            f"dp.hooks.Compress) with a tensor or pipeline axis."
        )
    return TrainState(
        params, opt_state, model_state, step, jax.device_put(rng, replicated), extras, comm_state
    )


def _broadcast_from_rank0(sync: Strategy, tree: PyTree) -> PyTree:
    """Every leaf's rank-0 copy (its leading axis holds one copy per rank) on every rank."""
    axis, n = sync.axis_name, sync.n
    for leaf in jax.tree_util.tree_leaves(tree):
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != n:
            raise ValueError(
                f"Trainer.init: per_rank=True needs every leaf to have a leading "
                f"axis of size {n} (one copy per rank), got shape "
                f"{np.shape(leaf)}."
            )
    tree = jax.device_put(tree, NamedSharding(sync.mesh, P(axis)))

    def body(t):
        # Initial params cross devices here: rank 0's copy goes to every rank. A SUM of
        # rank 0's values and zeros is exact and typed replicated, so out_specs=P() holds.
        first = lax.axis_index(axis) == 0
        t = jax.tree_util.tree_map(lambda a: jnp.where(first, a[0], jnp.zeros_like(a[0])), t)
        return primitives.all_reduce(t, axis, "sum")

    f = jax.shard_map(body, mesh=sync.mesh, in_specs=P(axis), out_specs=P())
    return jax.jit(f)(tree)
