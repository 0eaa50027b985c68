"""The interface every gradient-sync strategy offers the step builder (optax-like).

A strategy turns per-rank *local* gradients into one optimizer step, in two halves around
the step's ``jax.shard_map``, plus the placement both halves need:

* :meth:`GradSync.init` builds the optimizer state, placed on the mesh (its placement is the
  strategy's: replicated for :class:`~jaxcoll.dp.sync.AllReduce`, 1/n per device for
  :class:`~jaxcoll.dp.sync.Zero1` and :class:`~jaxcoll.dp.sync.Fsdp`);
  :meth:`GradSync.init_comm` the communication hook's state (one per bucket and rank);
* :meth:`GradSync.materialize` runs per rank inside ``shard_map`` and gives the loss the
  whole params from the params as the train state holds them (:meth:`state_param_specs`:
  replicated, or 1/n per device for FSDP);
* :meth:`GradSync.reduce` runs per rank inside ``shard_map`` (checking on) and returns the
  synchronised gradients, laid out as :meth:`GradSync.grad_specs` says (the shard_map's
  ``out_specs``), and the hook's new state;
* :meth:`GradSync.update` runs in ``jax.jit``'s global view, after the shard_map and inside
  the same program: ``update(grads, opt_state, params) -> (params, opt_state)``, the params
  placed as :meth:`state_param_specs` says.

State lives in pytrees (the optimizer state); a strategy object holds only configuration,
so one is safe to share and to rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..._core.typing import AxisName, PyTree
from ..buckets import plan_buckets
from ..hooks.base import AllReduceHook, init_state


def is_spec(x: Any) -> bool:
    return isinstance(x, P)


def specs_like(tree: PyTree, spec: P) -> PyTree:
    """``spec`` for every leaf of ``tree``."""
    return jax.tree_util.tree_map(lambda _: spec, tree)


@dataclass(frozen=True)
class GradSync:
    """Base of the gradient-sync strategies: configuration plus the shared placement code.

    Attributes:
        optimizer: the ``optax.GradientTransformation`` the strategy steps.
        mesh: the device mesh.
        axis_name: the data axis (or tuple of axes) of ``mesh``.
        algorithm: the collective algorithm (:data:`jaxcoll.algorithms.ALGORITHMS`).
        bucket_bytes: bucket size in bytes for the all-reduced gradients; None: one
            collective per leaf.
        comm_hook: the communication hook each bucket goes through (:mod:`jaxcoll.dp.hooks`);
            None: DDP's default, the exact mean in the gradients' own dtype.
    """

    #: How a param's gradient crosses the devices, as error messages say it.
    grad_route: ClassVar[str] = "synchronised over the devices"

    optimizer: optax.GradientTransformation
    mesh: Mesh
    axis_name: AxisName
    algorithm: str = "auto"
    bucket_bytes: float | None = 25.0 * 2**20
    comm_hook: Any = None

    @property
    def hook(self) -> Any:
        """The communication hook (DDP's default when none was given)."""
        return AllReduceHook() if self.comm_hook is None else self.comm_hook

    @property
    def n(self) -> int:
        """The number of ranks the batch is split over."""
        names = self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)
        return int(np.prod([self.mesh.shape[a] for a in names]))

    def named(self, specs: PyTree) -> PyTree:
        """``NamedSharding`` on the strategy's mesh for every ``PartitionSpec`` in ``specs``."""
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs,
                                      is_leaf=is_spec)

    # ---------------------------------------------------------------------------- placement
    def state_param_specs(self, params: PyTree) -> PyTree:
        """Where the train state holds each param between steps: replicated by default."""
        return specs_like(params, P())

    def extra_specs(self, extra: PyTree, params: PyTree) -> PyTree:
        """Where the train state holds ``extra`` (:class:`~jaxcoll.dp.Extra`): replicated."""
        return specs_like(extra, P())

    def param_specs(self, params: PyTree) -> PyTree:
        """Where the optimizer sees each param (and its gradient): replicated by default."""
        return specs_like(params, P())

    def grad_specs(self, params: PyTree) -> PyTree:
        """The layout :meth:`reduce` returns the gradients in (the shard_map's out_specs)."""
        return self.param_specs(params)

    def opt_specs(self, opt_state: PyTree, params: PyTree) -> PyTree:
        """The placement of every optimizer-state leaf: replicated by default."""
        return specs_like(opt_state, P())

    def opt_shardings(self, params: PyTree) -> PyTree:
        """The ``NamedSharding`` of every leaf of ``optimizer.init(params)``."""
        shapes = jax.eval_shape(self.optimizer.init, params)
        return self.named(self.opt_specs(shapes, params))

    # ----------------------------------------------------------------- the optax-like pair
    def init(self, params: PyTree) -> PyTree:
        """The optimizer state of the replicated ``params``, placed as :meth:`opt_specs` says.

        One jitted ``optimizer.init`` on the params as the optimizer sees them (a local slice
        each for sharded leaves: no communication).
        """
        shardings = self.named(self.param_specs(params))
        init = lambda p: self.optimizer.init(  # noqa: E731
            jax.lax.with_sharding_constraint(p, shardings))
        return jax.jit(init, out_shardings=self.opt_shardings(params))(params)

    def init_comm(self, params: PyTree) -> PyTree:
        """The hook's state for the gradients of ``params``: ``{}`` for a stateless hook,
        else a list with one state per bucket, every leaf stacked per rank (a leading axis
        of n, split over the data axis: each device holds its own rank's state)."""
        leaves = jax.tree_util.tree_leaves(params)
        shapes = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
        states = [init_state(self.hook, [shapes[i] for i in bucket], k)
                  for k, bucket in enumerate(plan_buckets(shapes, self.bucket_bytes))]
        if not jax.tree_util.tree_leaves(states):
            return {}
        n = self.n

        def stack(tree):
            return jax.tree_util.tree_map(
                lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (n, *np.shape(x))), tree)

        sharding = NamedSharding(self.mesh, P(self.axis_name))
        return jax.jit(lambda: stack(states), out_shardings=sharding)()

    def materialize(self, params: PyTree, like: PyTree) -> PyTree:
        """Per rank, inside ``shard_map``: the whole params the loss sees (identity here).
        ``like``: the params' global shapes (``jax.ShapeDtypeStruct``)."""
        return params

    def wrap_loss(self, fn: Any) -> Any:
        """The per-rank loss of the params as held, for ``jax.grad`` (unchanged here)."""
        return fn

    def reduce(self, grads: PyTree, comm_state: PyTree, step: jax.Array,
               like: PyTree = None) -> tuple[PyTree, PyTree]:  # pragma: no cover - interface
        """Per rank, inside ``shard_map``: the local gradients -> the synchronised ones,
        and the hook's new state (``comm_state``: this rank's own state). ``like``: the
        params' global shapes; ``step``: the steps taken before this one."""
        raise NotImplementedError

    def update(self, grads: PyTree, opt_state: PyTree,
               params: PyTree) -> tuple[PyTree, PyTree]:  # pragma: no cover - interface
        """Global view, inside the step's jit: ``(new replicated params, new opt_state)``."""
        raise NotImplementedError
