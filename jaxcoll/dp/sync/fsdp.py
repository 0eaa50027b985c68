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
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from ..._core.checks import check_optional
from ..._core.typing import AxisName, PyTree
from ..._core.vma import as_invariant, axis_names, to_varying
from ..._jax import jaxpr_parts
from ..checks import removed_keywords
from ..hooks.base import wire_dtype as hook_wire_dtype
from ..specs import used_dims
from .blocks import block_units
from .layerwise import gather_per_layer
from .packing import divides_after, gather_leaves, scatter_leaves, sum_leaves
from .quantized import Blocks, Quantize
from .zero1 import SHARD_AXIS_GONE, ZeRO1

#: The name the gathered params carry in the loss (``jax.ad_checkpoint.checkpoint_name``): the
#: rematerialisation policy of :func:`not_gathered` never saves them for the backward.
GATHERED = "jaxcoll_fsdp_params"


@removed_keywords(shard_axis=SHARD_AXIS_GONE)
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
       local gradients (:func:`~jaxcoll.primitives.reduce_scatter`, in the hook's wire
       dtype) divided by n (the slice after the sum, or each gradient before it when it
       travels narrower than its own dtype), so ``jax.grad`` returns each device its slice
       of the mean, layer by layer as the backward pass reaches it; the replicated leaves
       are all-reduced by buckets;
    2. with ``reshard_after_forward`` (default), the loss is rematerialised
       (``jax.checkpoint``) with a policy that saves everything but the gathered params: the
       backward gathers each leaf again where it needs it instead of keeping the whole
       params alive from the forward (torch FSDP's option of the same name); the
       activations are saved as usual. A scan's body over layers is always rematerialised
       that way (else the forward would save every gathered layer for the backward);
    3. in the global view: ``optimizer.update`` and ``optax.apply_updates`` on the sharded
       tree; the params stay sharded (no all-gather after the update).

    Leaves with no dimension divisible by n (a bias of 10 on 8 devices) stay replicated.

    Hybrid sharding (HSDP, torch's ``HYBRID_SHARD``) where the Trainer's layout has a shard
    axis beside other data axes (``dp.Layout(replicate=2, shard=4)``, FSDP's default there):
    the params, gradients and optimizer state split over the shard axis and replicated over
    the others; the gathers and reduce-scatters stay within the shard axis (one host's
    devices, say) and only the gradient slices are all-reduced across the others.

    Args:
        bucket_mb: bucket size in MiB for the all-reduce of the leaves that stay replicated
            (as :class:`~jaxcoll.dp.sync.ZeRO1`'s); None: one collective per leaf.
        algorithm: the collective algorithm (as :class:`~jaxcoll.dp.sync.DDP`'s).
        hook: None (the exact mean) or :class:`~jaxcoll.dp.hooks.Compress` (as
            :class:`~jaxcoll.dp.sync.ZeRO1`'s).
        reshard_after_forward: gather the params again in the backward instead of keeping
            them whole from the forward (less memory, one more all-gather per leaf the
            backward needs); False: keep them (torch's ``reshard_after_forward=False``).
        prefetch: with ``reshard_after_forward``, the backward gathers the params of a
            block of an unrolled model (a segment of the loss) again while the next block's
            backward computes, one block ahead (torch FSDP's backward prefetch): the gather
            can overlap the compute where collectives run asynchronously (GPUs), and two
            blocks' params are gathered at a time; False: each block's when its own
            cotangent has arrived (one block at a time, the gather exposed). A scan over
            stacked layers is XLA's to pipeline either way.
        mp_policy: the mixed precision policy (:class:`~jaxcoll.dp.sync.MixedPrecisionPolicy`):
            each slice is cast to its ``param_dtype`` before the all-gather.
        quantize: what travels in 8 bits (:class:`~jaxcoll.dp.Quantize`, DeepSpeed
            ZeRO++'s qwZ and qgZ): the params' all-gather (``params=jnp.float8_e4m3fn``,
            dequantized to the compute dtype on arrival) and the gradients' reduce-scatter
            (``grads=jnp.int8``: an all-to-all of quantized parts, summed in float32),
            each with a float32 scale per block; None: neither.

    Example (8 devices)::

        >>> trainer = dp.Trainer(loss_fn, optax.adamw(1e-3), sync=dp.sync.FSDP())
        >>> state = trainer.init(params, rng)   # state.params: 1/8 of each split leaf
        >>> hsdp = dp.Trainer(loss_fn, optax.adamw(1e-3),
        ...                   layout=dp.Layout(replicate=2, shard=4))   # 1/4 per device
    """

    grad_route: ClassVar[str] = (
        "reduce-scattered (all-reduced where no dimension splits) "
        "over the devices (FSDP, sync=dp.sync.FSDP())"
    )

    reshard_after_forward: bool = True
    prefetch: bool = True
    quantize: Quantize | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("reshard_after_forward", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"{self.api}: {name} must be True or False, got "
                    f"{getattr(self, name)!r} instead."
                )
        q = self.quantize
        check_optional(self.api, "quantize", q, Quantize, "a dp.Quantize")
        if q is not None and q.grads is not None:
            said = (
                f"hook={self.hook!r}"
                if self.hook is not None
                else f"mp_policy={self.mp_policy!r}"
                if self.mp_policy is not None and self.mp_policy.reduce_dtype is not None
                else None
            )
            if said is not None:
                raise ValueError(
                    f"{self.api}: quantize={q!r} sends the gradients in {q.grads.name} and "
                    f"{said} says another dtype for them. Pass one: quantize=dp.Quantize("
                    f"grads=None, ...) to keep the other, or drop the other."
                )

    def state_param_specs(self, params: PyTree) -> PyTree:
        return self.param_specs(params)

    def extra_specs(self, extra: PyTree, params: PyTree) -> PyTree:
        """Extra state that mirrors the params (an EMA) is split like them."""
        return self.opt_specs(extra, params)

    def shard_dims(self, params: PyTree) -> list[int | None]:
        """Per leaf, the dimension FSDP splits it along: the first one after the leading
        one that :attr:`n_shard` divides (a stacked layer axis leads, so each layer's slice
        is split and a scan over layers gathers one layer at a time), else the leading one
        when it divides it, else None (replicated)."""
        n = self.n_shard
        models = self.model_leaf_specs(params)
        held = self.held_axes(params)
        return [
            None if h else fsdp_dim(tuple(np.shape(leaf)), n, used_dims(m))
            for leaf, m, h in zip(jax.tree_util.tree_leaves(params), models, held, strict=True)
        ]

    def _plan(self, dims: list[int], dtypes: tuple[Any, ...]) -> _Plan:
        policy = self.mp_policy
        return _Plan(
            dims=tuple(dims),
            dtypes=dtypes,
            compute=None if policy is None else policy.param_dtype,
            quant=self.quantize,
            axis=self.shard_axis_name,
            replicas=self.replica_axes,
            names=axis_names(self.axis_name),
            n=self.n,
            algorithm=self.algorithm,
            wire=hook_wire_dtype(self.bucket_hook),
            bucket_bytes=self.bucket_bytes,
        )

    def _gather_many(self, slices: list[jax.Array], dims: list[int]) -> list[jax.Array]:
        """Per rank: the whole params from this rank's slices, one all-gather per bucket
        over the shard axis; differentiable (the gradient: this rank's slice of the sum over
        the shard axis of the local gradients / n, one reduce-scatter per bucket)."""
        if not slices:
            return []
        return _gather(list(slices), self._plan(dims, tuple(s.dtype for s in slices)))

    def _gather_all(self, leaves: list[jax.Array], dims: list[int | None]) -> list[jax.Array]:
        """Every split leaf gathered, each by a gather of its own (what the loss is traced
        with: :func:`~jaxcoll.dp.sync.layerwise.gather_per_layer` finds them one by one)."""
        out = list(leaves)
        for i, d in enumerate(dims):
            if d is not None:
                (out[i],) = self._gather_many([leaves[i]], [d])
        return out

    def loss_of_held(self, fn: Callable[..., Any], like: PyTree) -> Callable[..., Any]:
        """``fn`` of the params as held, each stacked layer gathered inside the scan that
        uses it (:mod:`~jaxcoll.dp.sync.layerwise`), the other split leaves where the loss
        first uses them."""
        dims = self.shard_dims(like)
        return gather_per_layer(
            # The split leaves reach the loss in the policy's dtype already (their slices
            # are cast before the gather); this casts the others, and the batch.
            self.compute(fn),
            self._gather_many,
            dims,
            lambda leaves: self._gather_all(leaves, dims),
            policy=not_gathered,
            bucket_bytes=self.bucket_bytes,
            n=self.n_shard,
            remat=self.reshard_after_forward,
            units=block_units(like),
            prefetch=self.prefetch,
        )

    def reduce(
        self, grads: PyTree, comm_state: PyTree, step: jax.Array, like: PyTree = None
    ) -> tuple[PyTree, PyTree]:
        # The split leaves' gradients are already their slices of the mean (the gather's
        # gradient; with hybrid sharding summed over the replica axes there too, equal on
        # every replica: typed so here, no communication); the replicated leaves cross
        # devices here, one all-reduce per bucket.
        dims = self.shard_dims(like)
        grads = self.reduce_kept(grads, dims, scatter=False)
        if self.replica_axes:
            leaves, treedef = jax.tree_util.tree_flatten(grads)
            for i, d in enumerate(dims):
                if d is not None:
                    leaves[i] = as_invariant(leaves[i], self.replica_axes)
            grads = jax.tree_util.tree_unflatten(treedef, leaves)
        return grads, comm_state

    def update(self, grads: PyTree, opt_state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        shardings = self.named(self.param_specs(params))
        constrain = jax.lax.with_sharding_constraint
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = constrain(optax.apply_updates(params, updates), shardings)
        opt_state = constrain(opt_state, self.named(self.opt_specs(opt_state, params)))
        return params, opt_state


class _Plan(NamedTuple):
    """How a set of split leaves is gathered (hashable: the gather's static argument)."""

    dims: tuple[int, ...]  # each leaf's split dimension
    dtypes: tuple[Any, ...]  # each slice's dtype (the gradient's)
    compute: Any  # the dtype the slices are cast to before the gather (None: their own)
    quant: Quantize | None  # what travels in 8 bits
    axis: AxisName  # the axis (or axes) the leaves are split over
    replicas: tuple[str, ...]  # the data axes the slices are replicated over (HSDP)
    names: tuple[str, ...]  # every data axis (the gathered params vary over them all)
    n: int  # the number of data ranks (the gradient is the local one / n)
    algorithm: str
    wire: DTypeLike | None  # the dtype the gradients travel in
    bucket_bytes: float | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(slices: list[jax.Array], plan: _Plan) -> list[jax.Array]:
    """This rank's slices of some params -> the whole params (typed varying: each rank's
    loss uses them with its own examples). Its gradient: the reduce-scatter of the local
    gradient / n over the shard axis. With a mixed precision policy the slices are cast to
    its param dtype first, so the gather moves that dtype's bytes."""
    codec = _codec(plan, "params")
    dtypes = [plan.compute or s.dtype for s in slices]
    if plan.compute is not None and codec is None:
        slices = [s.astype(plan.compute) if _is_float(s) else s for s in slices]
    # Params cross devices here: one all-gather per bucket of split leaves (8-bit blocks
    # and their scales, two, with quantized params).
    wholes = gather_leaves(slices, plan.dims, plan.axis, **_route(plan, codec))
    wholes = [w.astype(dt) for w, dt in zip(wholes, dtypes, strict=True)]
    return [checkpoint_name(to_varying(w, plan.names), GATHERED) for w in wholes]


def _codec(plan: _Plan, what: str) -> Blocks | None:
    """How ``what`` ("params" or "grads") travels: in 8-bit blocks when the plan quantizes
    it, else None (as they are)."""
    dtype = None if plan.quant is None else getattr(plan.quant, what)
    return None if dtype is None else Blocks(dtype, plan.quant.block)  # type: ignore[union-attr]


def _route(plan: _Plan, codec: Blocks | None) -> dict[str, Any]:
    """The keywords of a gather or reduce-scatter of the plan's leaves."""
    return {"algorithm": plan.algorithm, "bucket_bytes": plan.bucket_bytes, "codec": codec}


def _is_float(x: jax.Array) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.floating))


def fsdp_dim(shape: tuple[int, ...], n: int, taken: frozenset[int] = frozenset()) -> int | None:
    """The dimension FSDP splits a leaf of ``shape`` along (see :meth:`FSDP.shard_dims`),
    never one in ``taken`` (split by the leaf's model spec)."""
    for d in range(1, len(shape)):
        if d not in taken and shape[d] > 0 and shape[d] % n == 0:
            return d
    if shape and 0 not in taken and shape[0] > 0 and shape[0] % n == 0:
        return 0
    return None


def not_gathered(prim: Any, *_: Any, **params: Any) -> bool:
    """The rematerialisation policy: save every value for the backward but the gathered
    params (the output of :func:`_gather`, which carries the name :data:`GATHERED`)."""
    if str(prim) == "name":
        return params.get("name") != GATHERED
    if str(prim) == "custom_vjp_call":
        body, _ = jaxpr_parts(params.get("call_jaxpr"))
        return not any(
            str(e.primitive) == "name" and e.params.get("name") == GATHERED
            for e in getattr(body, "eqns", ())
        )
    return True


def _gather_fwd(slices, plan):
    return _gather(slices, plan), None


def _gather_bwd(plan, _, cts):
    codec = _codec(plan, "grads")
    wire = plan.wire if codec is None else None
    # The mean's division: on the slice after the sum, or in the slice's dtype before it
    # when the gradients travel in another (bf16, 8-bit blocks).
    after = codec is None and divides_after(wire, plan.dtypes)
    # Back in the slice's dtype (the fp32 master's, under a policy that computes in bf16).
    cts = [to_varying(ct.astype(dt), plan.names) for ct, dt in zip(cts, plan.dtypes, strict=True)]
    if not after:
        cts = [ct / jnp.asarray(plan.n, ct.dtype) for ct in cts]
    # Gradients cross devices here: each rank receives only its slice of the sum, one
    # reduce-scatter per bucket (in the wire dtype), or, with quantized gradients, two
    # all-to-alls of 8-bit blocks and their scales, summed in float32.
    grads = scatter_leaves(cts, plan.dims, plan.axis, wire_dtype=wire, **_route(plan, codec))
    if plan.replicas:
        grads = _sum_over(grads, plan)
    if after:
        grads = [g / jnp.asarray(plan.n, g.dtype) for g in grads]
    return (grads,)


def _sum_over(slices: list[jax.Array], plan: _Plan) -> list[jax.Array]:
    """Hybrid sharding: each gradient slice summed over the replica axes, one all-reduce
    per bucket (in the wire dtype), as soon as the backward has it (a layer's inside a
    scan), typed varying again (the gather's input type; the values are equal on every
    replica, which :meth:`FSDP.reduce` types)."""
    sums = sum_leaves(
        slices,
        plan.replicas[0] if len(plan.replicas) == 1 else plan.replicas,
        algorithm=plan.algorithm,
        bucket_bytes=plan.bucket_bytes,
        wire_dtype=plan.wire,
    )
    return [to_varying(g, plan.names) for g in sums]


_gather.defvjp(_gather_fwd, _gather_bwd)
