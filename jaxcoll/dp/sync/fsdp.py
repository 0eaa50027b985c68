"""FSDP: ZeRO stage 3 (torch's FullyShardedDataParallel). Params, gradients and optimizer
state are all held 1/n per device; each step gathers the params where the loss uses them, one
layer at a time inside a scan over stacked layers.

Each leaf with a dimension divisible by n is split along the first such dimension after the
leading one (the leading one when no other divides; a stacked layer axis leads, so every
layer's slice is split), the others stay replicated; the params keep their pytree structure
and shapes, so the optimizer sees the real tree and every optax transformation gives the
unsharded result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from ... import primitives
from ..._core.typing import AxisName, PyTree
from ..._core.vma import axis_names, to_varying
from ..hooks.base import wire_dtype as hook_wire_dtype
from .layerwise import gather_per_layer
from .zero1 import ZeRO1

#: The name the gathered params carry in the loss (``jax.ad_checkpoint.checkpoint_name``): the
#: rematerialisation policy of :meth:`FSDP.wrap_loss` never saves them for the backward.
GATHERED = "jaxcoll_fsdp_params"


@dataclass(frozen=True, kw_only=True)
class FSDP(ZeRO1):
    """Gather the params for the loss, reduce-scatter the gradients, update 1/n everywhere.

    torch's ``FullyShardedDataParallel`` (ZeRO-3). Equivalent to
    :class:`~jaxcoll.dp.sync.DDP` (every optax transformation gives the unsharded result, up
    to float rounding), with each device holding only its slice of every split leaf's
    params, gradients and optimizer state between steps (``state.params`` is split). Per
    step:

    1. per rank, inside ``shard_map``: the split leaves are all-gathered
       (:func:`~jaxcoll.primitives.all_gather`, ``tiled=True``) where the loss uses them.
       A scan over stacked layers (``lax.scan``, flax ``nn.scan``, ``nnx.scan``, also
       inside a ``jax.jit`` or ``jax.checkpoint`` of the loss) scans the slices instead and
       gathers its own layer in each iteration (:mod:`~jaxcoll.dp.sync.layerwise`), so the
       forward holds one gathered layer at a time; the other split leaves are gathered
       together at their first use. The gather's gradient is the reduce-scatter of the
       local gradient divided by n (:func:`~jaxcoll.primitives.reduce_scatter`, in the
       hook's wire dtype), so ``jax.grad`` returns each device its slice of the mean, layer
       by layer as the backward pass reaches it; the replicated leaves are all-reduced by
       buckets;
    2. with ``reshard_after_forward`` (default), the loss is rematerialised
       (``jax.checkpoint``) with a policy that saves everything but the gathered params: the
       backward gathers each leaf again where it needs it instead of keeping the whole
       params alive from the forward (torch FSDP's option of the same name); the
       activations are saved as usual. A scan's body over layers is always rematerialised
       that way (else the forward would save every gathered layer for the backward);
    3. in the global view: ``optimizer.update`` and ``optax.apply_updates`` on the sharded
       tree; the params stay sharded (no all-gather after the update).

    Leaves with no dimension divisible by n (a bias of 10 on 8 devices) stay replicated.

    Args:
        bucket_mb: bucket size in MiB for the all-reduce of the leaves that stay replicated
            (as :class:`~jaxcoll.dp.sync.ZeRO1`'s); None: one collective per leaf.
        algorithm: the collective algorithm (as :class:`~jaxcoll.dp.sync.DDP`'s).
        hook: None (the exact mean) or :class:`~jaxcoll.dp.hooks.Compress` (as
            :class:`~jaxcoll.dp.sync.ZeRO1`'s).
        reshard_after_forward: gather the params again in the backward instead of keeping
            them whole from the forward (less memory, one more all-gather per leaf the
            backward needs); False: keep them (torch's ``reshard_after_forward=False``).

    Example (8 devices)::

        >>> trainer = dp.Trainer(loss_fn, optax.adamw(1e-3), sync=dp.sync.FSDP())
        >>> state = trainer.init(params, rng)   # state.params: 1/8 of each split leaf
    """

    grad_route: ClassVar[str] = (
        "reduce-scattered (all-reduced where no dimension splits) "
        "over the devices (FSDP, sync=dp.sync.FSDP())"
    )

    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                f"{self.api}: reshard_after_forward must be True or False, got "
                f"{self.reshard_after_forward!r} instead."
            )

    def state_param_specs(self, params: PyTree) -> PyTree:
        return self.param_specs(params)

    def extra_specs(self, extra: PyTree, params: PyTree) -> PyTree:
        """Extra state that mirrors the params (an EMA) is split like them."""
        return self.opt_specs(extra, params)

    def shard_dims(self, params: PyTree) -> list[int | None]:
        """Per leaf, the dimension FSDP splits it along: the first one after the leading
        one that n divides (a stacked layer axis leads, so each layer's slice is split and
        a scan over layers gathers one layer at a time), else the leading one when n
        divides it, else None (replicated)."""
        return [
            fsdp_dim(tuple(np.shape(leaf)), self.n) for leaf in jax.tree_util.tree_leaves(params)
        ]

    def _gather_leaf(self, x: jax.Array, dim: int) -> jax.Array:
        wire = hook_wire_dtype(self.bucket_hook)
        return _gather(x, dim, self.axis_name, self.n, self.algorithm, wire)

    def _gather_all(self, leaves: list[jax.Array], dims: list[int | None]) -> list[jax.Array]:
        return [
            x if d is None else self._gather_leaf(x, d) for x, d in zip(leaves, dims, strict=True)
        ]

    def _gather_many(self, slices: list[jax.Array], dims: list[int]) -> list[jax.Array]:
        return [self._gather_leaf(x, d) for x, d in zip(slices, dims, strict=True)]

    def materialize(self, params: PyTree, like: PyTree) -> PyTree:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        return jax.tree_util.tree_unflatten(
            treedef, self._gather_all(leaves, self.shard_dims(like))
        )

    def loss_of_held(self, fn: Callable[..., Any], like: PyTree) -> Callable[..., Any]:
        """``fn`` of the params as held, each stacked layer gathered inside the scan that
        uses it (:mod:`~jaxcoll.dp.sync.layerwise`), the other split leaves where the loss
        first uses them."""
        dims = self.shard_dims(like)
        run = gather_per_layer(
            fn,
            self._gather_many,
            dims,
            lambda leaves: self._gather_all(leaves, dims),
            policy=not_gathered,
        )
        return self.wrap_loss(run)

    def wrap_loss(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self.reshard_after_forward:
            return fn
        return jax.checkpoint(fn, policy=not_gathered)

    def reduce(
        self, grads: PyTree, comm_state: PyTree, step: jax.Array, like: PyTree = None
    ) -> tuple[PyTree, PyTree]:
        # The split leaves' gradients are already their slices of the mean (the gather's
        # gradient); the replicated leaves cross devices here, one all-reduce per bucket.
        return self.reduce_kept(grads, self.shard_dims(like), scatter=False), comm_state

    def update(self, grads: PyTree, opt_state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        shardings = self.named(self.param_specs(params))
        constrain = jax.lax.with_sharding_constraint
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = constrain(optax.apply_updates(params, updates), shardings)
        opt_state = constrain(opt_state, self.named(self.opt_specs(opt_state, params)))
        return params, opt_state


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gather(
    x: jax.Array, dim: int, axis_name: AxisName, n: int, algorithm: str, wire: DTypeLike | None
) -> jax.Array:
    """This rank's slice ``x`` of a param -> the whole param (typed varying: each rank's
    loss uses it with its own examples). Its gradient: the reduce-scatter of the mean."""
    # Params cross devices here: one all-gather per split leaf.
    whole = primitives.all_gather(x, axis_name, axis=dim, tiled=True, algorithm=algorithm)
    return checkpoint_name(to_varying(whole, axis_names(axis_name)), GATHERED)


def fsdp_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The dimension FSDP splits a leaf of ``shape`` along (see :meth:`FSDP.shard_dims`)."""
    for d in range(1, len(shape)):
        if shape[d] > 0 and shape[d] % n == 0:
            return d
    if shape and shape[0] > 0 and shape[0] % n == 0:
        return 0
    return None


def not_gathered(prim: Any, *_: Any, **params: Any) -> bool:
    """The rematerialisation policy: save every value for the backward but the gathered
    params (the output of :func:`_gather`, which carries the name :data:`GATHERED`)."""
    if str(prim) == "name":
        return params.get("name") != GATHERED
    if str(prim) == "custom_vjp_call":
        body = getattr(params.get("call_jaxpr"), "jaxpr", None)
        return not any(
            str(e.primitive) == "name" and e.params.get("name") == GATHERED
            for e in getattr(body, "eqns", ())
        )
    return True


def _gather_fwd(x, dim, axis_name, n, algorithm, wire):
    return _gather(x, dim, axis_name, n, algorithm, wire), None


def _gather_bwd(dim, axis_name, n, algorithm, wire, _, ct):
    ct = to_varying(ct, axis_names(axis_name))
    g = (ct / jnp.asarray(n, ct.dtype)).astype(wire or ct.dtype)
    # Gradients cross devices here: each rank receives only its slice of the mean.
    g = primitives.reduce_scatter(
        g, axis_name, "sum", scatter_dimension=dim, tiled=True, algorithm=algorithm
    )
    return (g.astype(ct.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)
