"""Semi-synchronous training: :class:`DiLoCo`, :class:`LocalSGD` and :class:`StreamingDiLoCo`.
Replicas step on their own params and meet every few steps.

The data replicas (the devices of the layout's first data axis, its replicate axis) each
train their own copy of the params: every step, the gradients are averaged only *within* a
replica (over the other data axes, by the ``inner`` strategy) and the replica takes an inner
optimizer step on its own params. Every ``every`` steps the replicas meet: the pseudo-gradient
``global - local`` is averaged over them (one all-reduce of the params' size across replicas),
an outer optimizer steps the global params with it, and every replica starts again from them
(Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language Models*;
:class:`LocalSGD` is the plain average of the replicas' params, Lin et al., *Don't Use Large
Mini-Batches, Use Local SGD*; :class:`~jaxcoll.dp.sync.StreamingDiLoCo`, in
:mod:`jaxcoll.dp.sync.streaming`, meets by fragments of the params). With
``quantize=dp.Quantize(grads=jnp.int8)`` the pseudo-gradients cross replicas in 8 bits, a
float32 scale per block (:meth:`DiLoCo.replica_mean`).

The train state's ``params`` are the global (outer) params, the same on every device: what
``Trainer.evaluate``, a checkpoint and ``trainer.host_params`` see. The optimizer state
(:class:`SemiSyncState`) holds the replicas' own params and inner optimizer states (a
leading axis of one entry per replica, split over the replicate axis) and the outer
optimizer's state. A step is one of two programs (the strategy's phases: ``phase(step)``):
an inner step, with no collective across replicas but the metrics' scalars, and a sync step,
the inner step then the meeting; a third, the synchronous step, runs the first ``warmup``
steps.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from ..._core.checks import check_count, check_optional
from ..._core.typing import PyTree
from ..hooks.base import Compress
from ..layout import BoundLayout
from .base import Prepared, Strategy, is_spec, mirror_specs, specs_like
from .ddp import DDP
from .fsdp import FSDP
from .quantized import Quantize, quantized_mean

#: DiLoCo's outer optimizer in its paper: Nesterov momentum.
NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)
#: LocalSGD's outer step as an optimizer: the params become the replicas' mean.
AVERAGE = optax.sgd(1.0)


class SemiSyncState(NamedTuple):
    """The optimizer state of :class:`DiLoCo`, :class:`LocalSGD` and
    :class:`StreamingDiLoCo` (``state.opt_state``).

    Attributes:
        local: each replica's own params: every leaf with a leading axis of one entry per
            replica, split over the replicate axis (each device holds its replica's).
        inner: each replica's inner optimizer state (the Trainer's ``optimizer``), stacked
            and placed as ``local``; never averaged across replicas.
        outer: the outer optimizer's state, for the global params (placed like them);
            :class:`StreamingDiLoCo`'s: a tuple of one per fragment.
    """

    local: PyTree
    inner: PyTree
    outer: PyTree


def _stack(tree: PyTree, count: int) -> PyTree:
    """Every leaf repeated ``count`` times along a new leading axis."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x[None], (count, *x.shape)), tree)


@dataclass(frozen=True, kw_only=True)
class DiLoCo(Strategy):
    """Replicas take ``every`` inner steps on their own params, then an outer step together.

    Equivalent to (``R`` replicas; replica ``r`` gets its rows of each global batch, as the
    layout splits it; the Trainer's ``optimizer`` is the inner one)::

        local = [params] * R; inner_state = [optimizer.init(params)] * R
        outer_state = outer.init(params)
        for step, batch in enumerate(batches):
            if step < warmup:                           # synchronous: DDP's (HSDP's) step
                g = grad(loss)(params, batch)           # mean over every replica's rows
                for r in range(R):                      # the same update in each
                    u, inner_state[r] = optimizer.update(g, inner_state[r], params)
                params = optax.apply_updates(params, u)
                local = [params] * R
                continue
            for r in range(R):                          # no communication across replicas
                g = grad(loss)(local[r], rows_of_replica(batch, r))  # mean within the replica
                u, inner_state[r] = optimizer.update(g, inner_state[r], local[r])
                local[r] = optax.apply_updates(local[r], u)
            if (step - warmup + 1) % every == 0:        # one all-reduce of the params' size
                delta = params - mean(local)            # the pseudo-gradient
                u, outer_state = outer.update(delta, outer_state, params)
                params = optax.apply_updates(params, u)
                local = [params] * R

    ``state.params`` are the global ``params`` (changed only at a sync step, the same on
    every device); ``state.opt_state`` is a :class:`SemiSyncState`.

    The replicas are the devices of the layout's first data axis (``dp.Layout(replicate=8)``:
    8 replicas of one device; ``dp.Layout(replicate=("node", "local"))`` on a mesh
    ``("node", "local")``: a replica per node, and within it ``inner`` averages the gradients
    over ``"local"`` every step; with ``inner=dp.sync.FSDP()`` each replica's params,
    gradients and inner optimizer state are split over ``"local"`` too, and so are the
    global params and the outer state). Each step compiles to one of two programs (the strategy's
    phases): an inner step, whose only collectives across replicas are the metrics' (a few
    scalars: the loss is the mean over every replica's rows, each on its own params) and the
    model state's (BatchNorm statistics, averaged over every data axis each step as with any
    strategy); and a sync step (``(step + 1) % every == 0``), the inner step followed by one
    all-reduce of the params' size across replicas. The bytes that cross replicas per step
    are thus ``every`` times fewer than :class:`~jaxcoll.dp.sync.DDP`'s.

    Args:
        inner: how the gradients are averaged within a replica every step:
            :class:`~jaxcoll.dp.sync.DDP` (whole params on each device) or
            :class:`~jaxcoll.dp.sync.FSDP` (each replica's state split over its devices:
            HSDP within, DiLoCo across), with their options (``bucket_mb``, ``algorithm``,
            ``mp_policy``; a ``dp.hooks.Compress`` hook). Default ``DDP()``.
        every: the inner steps between two meetings of the replicas (H in the paper): a
            positive int. ``every=1`` with ``outer=optax.sgd(1.0)`` and an inner optimizer
            linear in the gradients (SGD, with or without momentum) is DDP's training.
        outer: the outer optimizer (an ``optax.GradientTransformation``), stepping the
            global params with the replicas' mean pseudo-gradient ``params - local`` as its
            gradient. Default: ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` (the paper's).
        quantize: ``dp.Quantize(grads=jnp.int8)`` (or a float8 dtype; ``block``: elements
            per float32 scale): each replica's pseudo-gradient ``params - local`` crosses
            replicas in 8 bits, about 4x fewer bytes than the float32 all-reduce
            (:meth:`replica_mean`). None (default): the exact float32 mean.
        warmup: the steps trained synchronously before the first inner step (default 0):
            each averages the gradients over every replica and takes the inner optimizer's
            step in all of them alike (DDP's step, or HSDP's with ``inner=FSDP()``; its
            bytes across replicas the gradients' and the params' all-reduce), the global
            params following. The meetings count from its end. DiLoCo starts from a
            synchronously trained model in its paper; a few synchronous steps at the start
            of a run from scratch close most of its gap to synchronous training (the GPT
            example: ``benchmarks/diloco.py``).

    Raises:
        TypeError, ValueError: a field has a wrong type or value (at construction), or the
            Trainer's layout has no replicate axis of more than one device, or axes that are
            no data replicas (context, tensor, pipeline, expert; a shard axis but with
            ``inner=FSDP()``).

    Example (8 devices: 2 replicas of 4)::

        >>> mesh = jax.make_mesh((2, 4), ("node", "local"))
        >>> trainer = dp.Trainer(loss_fn, optax.adamw(1e-3), mesh=mesh,
        ...                      layout=dp.Layout(replicate=("node", "local")),
        ...                      sync=dp.sync.DiLoCo(every=8))
    """

    grad_route: ClassVar[str] = (
        "averaged within each replica every step and across replicas every few steps (DiLoCo)"
    )

    inner: Strategy = DDP()
    every: int
    outer: optax.GradientTransformation = NESTEROV
    quantize: Quantize | None = None
    warmup: int = 0
    _sync: bool | None = field(default=None, init=False, repr=False)
    _warm: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        api = self.api
        for name in ("hook", "mp_policy"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{api}: {name}={getattr(self, name)!r} belongs to the inner strategy, "
                    f"which averages the gradients; pass inner=dp.sync.DDP({name}=...)."
                )
        self._check_inner()
        check_count(api, "every", self.every, 1, "the inner steps between two syncs, e.g. 8")
        check_count(api, "warmup", self.warmup, 0, "synchronous steps first")
        if not isinstance(self.outer, optax.GradientTransformation):
            raise TypeError(
                f"{api}: outer must be an optax.GradientTransformation (e.g. "
                f"optax.sgd(0.7, momentum=0.9, nesterov=True)), got {self.outer!r} of type "
                f"{type(self.outer).__name__} instead."
            )
        q = self.quantize
        check_optional(api, "quantize", q, Quantize, "a dp.Quantize")
        if q is not None and (q.grads is None or q.params is not None):
            raise ValueError(
                f"{api}: quantize={q!r} must name the pseudo-gradients' dtype as grads and "
                f"no params dtype (the replicas send pseudo-gradients only); pass "
                f"quantize=dp.Quantize(grads=jnp.int8)."
            )

    def _check_inner(self) -> None:
        api, inner = self.api, self.inner
        if isinstance(inner, type) and issubclass(inner, Strategy):
            raise TypeError(
                f"{api}: inner=dp.sync.{inner.__name__} is a class: pass a value, e.g. "
                f"inner=dp.sync.{inner.__name__}()."
            )
        if not isinstance(inner, Strategy):
            raise TypeError(
                f"{api}: inner must be a gradient-sync strategy (dp.sync.DDP()), got "
                f"{inner!r} of type {type(inner).__name__} instead."
            )
        if type(inner) not in (DDP, FSDP):
            raise ValueError(
                f"{api}: inner={type(inner).__name__}() is not supported; pass "
                f"inner=dp.sync.DDP() (whole params in each replica) or dp.sync.FSDP() "
                f"(each replica's params split over its devices)."
            )
        if inner.hook is not None and not isinstance(inner.hook, Compress):
            raise ValueError(
                f"{api}: inner=DDP(hook={inner.hook!r}) keeps state per bucket, which a "
                f"replica's own params do not carry yet; use hook=dp.hooks.Compress(...) "
                f"or none."
            )

    # ------------------------------------------------------------------------- preparation
    def check_prepared(self, prepared: Prepared) -> None:
        """Raise ValueError unless the layout's first data axis is a replicate axis of more
        than one device, and the others are replicate axes (a shard axis too with
        ``inner=FSDP()``: HSDP's); no context or model axes."""
        layout = prepared.layout
        given, api = layout.layout, self.api
        fsdp = isinstance(self.inner, FSDP)
        roles = (
            ("context", given.context_axis),
            ("tensor", given.tensor_axis),
            ("pipeline", given.pipeline_axis),
            ("expert", given.expert_axis),
        )
        others = [f"{role}={axis!r}" for role, axis in roles if axis is not None]
        if given.shard_axis is not None and not fsdp:
            others.insert(0, f"shard={given.shard_axis!r} (with inner=dp.sync.DDP())")
        if others:
            raise ValueError(
                f"{api}: the layout {given!r} has {', '.join(others)}; each replica holds "
                f"its params whole (inner=dp.sync.DDP()) or split over its shard axis "
                f"(inner=dp.sync.FSDP()), so the layout may name data replicas only (e.g. "
                f"dp.Layout(replicate=('node', 'local')) with a mesh of those axes)."
            )
        axis = layout.data_axes[0]
        if axis in (given.shard_axis,) or layout.mesh.shape[axis] < 2:
            raise ValueError(
                f"{api}: {given!r} has no replicate axis of 2 devices or more (its first data "
                f"axis {axis!r} has {layout.mesh.shape[axis]}); semi-synchronous training "
                f"needs at least 2 replicas: a layout whose first replicate axis has 2 "
                f"devices or more (e.g. dp.Layout(replicate=8)), or sync=dp.sync.DDP()."
            )
        if fsdp and not layout.data_axes[1:]:
            raise ValueError(
                f"{api}: inner=FSDP() splits each replica's params over the data axes within "
                f"a replica, and {given!r} has none (its only data axis {axis!r} is the "
                f"replicas'); use inner=dp.sync.DDP(), or a layout of two data axes "
                f"(dp.Layout(replicate=('node', 'local')) with a mesh of those axes)."
            )

    def prepare(self, optimizer: optax.GradientTransformation, layout: BoundLayout) -> Strategy:
        """A copy prepared for the inner ``optimizer`` and ``layout``; ``inner`` prepared for
        the data axes within a replica (those after the replicate axis), if any."""
        out = super().prepare(optimizer, layout)
        within = layout.data_axes[1:]
        if within:
            inner = self.inner.prepare(optimizer, dataclasses.replace(layout, data_axes=within))
            object.__setattr__(out, "inner", inner)
        return out

    @property
    def replica_axis(self) -> str:
        """The mesh axis across replicas (prepared): the layout's first data axis."""
        return self.layout.data_axes[0]

    @property
    def replicas(self) -> int:
        """The number of replicas (prepared)."""
        return int(self.mesh.shape[self.replica_axis])

    # ------------------------------------------------------------------------------- phases
    @property
    def phased(self) -> bool:
        """True: an inner step and a sync step are two programs."""
        return True

    def phase(self, step: int) -> Strategy:
        """The strategy that runs step ``step``: a synchronous step's while
        ``step < warmup``, then the sync step's where ``(step - warmup + 1) % every == 0``
        (:meth:`_schedule`), else the inner step's."""
        out = copy.copy(self)
        inner_step = int(step) - self.warmup
        object.__setattr__(out, "_warm", inner_step < 0)
        object.__setattr__(out, "_sync", False)
        if inner_step >= 0:
            out._schedule(inner_step)
        return out

    def _schedule(self, step: int) -> None:
        """Set this phase's meeting for step ``step`` counted from the first inner one."""
        object.__setattr__(self, "_sync", (step + 1) % self.every == 0)

    # ---------------------------------------------------------------------------- placement
    def _stacked(self, specs: PyTree) -> PyTree:
        """Every spec of ``specs`` with the replicate axis in front (a leading axis of one
        entry per replica)."""
        axis = self.replica_axis
        return jax.tree_util.tree_map(lambda s: P(axis, *s), specs, is_leaf=is_spec)

    def state_param_specs(self, params: PyTree) -> PyTree:
        """The global params: placed within a replica as ``inner`` holds them (whole for
        DDP, split over the replica's devices for FSDP), the same on every replica."""
        if not self.layout.data_axes[1:]:
            return super().state_param_specs(params)
        return self.inner.state_param_specs(params)

    def held(self, params: PyTree, opt_state: PyTree) -> PyTree:
        """The replicas' own params (``opt_state.local``): what the loss differentiates."""
        return opt_state.local

    def held_specs(self, params: PyTree) -> PyTree:
        """The replicas' params: a leading axis split over the replicas, each replica's
        placed as :meth:`state_param_specs` says."""
        return self._stacked(self.state_param_specs(params))

    def own_held(self, held: PyTree) -> PyTree:
        """Per rank: this replica's params (as ``inner`` holds them) from its (1, ...)
        block."""
        return jax.tree_util.tree_map(lambda x: x[0], held)

    def grad_specs(self, params: PyTree) -> PyTree:
        """The gradients as ``inner`` returns them, stacked per replica."""
        if not self.layout.data_axes[1:]:
            return self._stacked(specs_like(params, P()))
        return self._stacked(self.inner.grad_specs(params))

    def opt_specs(self, opt_state: PyTree, params: PyTree) -> PyTree:
        """``local`` as :meth:`held_specs`; each ``inner`` leaf that mirrors a param placed
        like it, the others split over the replicas alone; ``outer`` placed like the global
        params."""
        axis = self.replica_axis
        local = self.held_specs(params)
        inner = mirror_specs(opt_state.inner, opt_state.local, local)
        inner = jax.tree_util.tree_map(lambda s: P(axis) if s == P() else s, inner, is_leaf=is_spec)
        return SemiSyncState(local, inner, self.outer_specs(opt_state.outer, params))

    # ------------------------------------------------------------------------ the step pair
    def init(self, params: PyTree) -> PyTree:
        """The :class:`SemiSyncState` of the global ``params``: every replica's params a copy
        of them, its inner state ``optimizer.init`` of them, the outer state
        ``outer.init(params)``; placed as :meth:`opt_specs` says."""
        count = self.replicas

        def build(p):
            local = _stack(p, count)
            return SemiSyncState(local, jax.vmap(self.optimizer.init)(local), self.outer_init(p))

        shapes = jax.eval_shape(build, params)
        return jax.jit(build, out_shardings=self.named(self.opt_specs(shapes, params)))(params)

    def outer_init(self, params: PyTree) -> PyTree:
        """The outer optimizer's state for the global ``params``: ``outer.init(params)``."""
        return self.outer.init(params)

    def outer_specs(self, outer_state: PyTree, params: PyTree) -> PyTree:
        """The outer state's placement: each leaf that mirrors a param placed like the
        global params (:meth:`state_param_specs`), the others replicated."""
        return mirror_specs(outer_state, params, self.state_param_specs(params))

    def loss_of_held(self, fn: Any, like: PyTree) -> Any:
        """The inner strategy's (whole params for DDP; gathered within the replica for
        FSDP)."""
        return self.inner.loss_of_held(fn, like)

    def reduce(
        self, grads: PyTree, comm_state: PyTree, step: jax.Array, like: PyTree = None
    ) -> tuple[PyTree, PyTree]:
        """Per rank: the gradients averaged within the replica by ``inner`` (nothing to
        average for a replica of one device), stacked as this replica's (1, ...) block."""
        if self.layout.data_axes[1:]:
            # Gradients cross devices here, within the replica only (inner's all-reduce).
            grads, comm_state = self.inner.reduce(grads, comm_state, step, like)
        if self._warm:
            grads = jax.tree_util.tree_map(lambda g: jax.lax.pmean(g, self.replica_axis), grads)
        return jax.tree_util.tree_map(lambda g: g[None], grads), comm_state

    def update(self, grads: PyTree, opt_state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        """Global view: every replica's inner step on its own params (no communication);
        at a sync step then the outer step (:meth:`outer_step`) and every replica reset to
        the new global params."""
        if self._sync is None:
            raise RuntimeError(
                f"{self.api}: update runs one of two programs; take the step's strategy with "
                f".phase(step) (dp.Trainer does)."
            )
        start, inner, outer = opt_state
        updates, inner = jax.vmap(self.optimizer.update)(grads, inner, start)
        local = optax.apply_updates(start, updates)
        constrain = jax.lax.with_sharding_constraint  # each replica's own: no communication
        local = constrain(local, self.named(self.held_specs(params)))
        if self._warm:
            params = jax.tree_util.tree_map(lambda x: jnp.mean(x, axis=0), local)
        elif self._sync:
            params, local, outer = self.meet(params, local, outer, start)
        return params, SemiSyncState(local, inner, outer)

    def meet(
        self, params: PyTree, local: PyTree, outer: PyTree, start: PyTree = None
    ) -> tuple[PyTree, PyTree, Any]:
        """Global view, at a sync step: ``(params, local, outer)`` after the replicas meet:
        the outer step (:meth:`outer_step`) with their mean params (:meth:`replica_mean` of
        ``local``, the params after this step's inner update), every replica reset to the
        new global params. ``start``: the replicas' params before it (unused here)."""
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        specs = jax.tree_util.tree_leaves(self.state_param_specs(params), is_leaf=is_spec)
        mean = self.replica_mean(p_leaves, jax.tree_util.tree_leaves(local), specs)
        params, outer = self.outer_step(params, jax.tree_util.tree_unflatten(treedef, mean), outer)
        return params, _stack(params, self.replicas), outer

    def replica_mean(self, params: list, local: list, specs: list) -> list:
        """Global view: the replicas' mean of each leaf of ``local`` (stacked per replica),
        ``params`` the global leaves and ``specs`` their placement.

        Without :attr:`quantize`, ``mean(local, axis=0)``: one float32 all-reduce across
        replicas. With it, ``params - mean_r(params - local[r])`` where the mean travels in
        8 bits, as FSDP's quantized reduce-scatter (:mod:`jaxcoll.dp.sync.quantized`) then
        a quantized all-gather: each replica's pseudo-gradient, all leaves flattened (each
        padded to whole blocks, so a block never mixes two leaves) into ``R`` rows, is
        quantized per block of ``quantize.block`` elements (rounded to nearest); one
        all-to-all gives each replica the ``R`` copies of its row, dequantized and averaged
        in float32; that row is quantized again and all-gathered. Each element is rounded
        twice, each time by at most half its block's ``max|x| / 127`` (int8); nothing is fed
        back. Bytes per replica: ``2 (R - 1) / R`` of the padded leaves at 1 byte (and a
        float32 scale per block), against ``2 (R - 1) / R`` at 4 bytes for the all-reduce.
        """
        if self.quantize is None:
            # Params cross replicas here: their mean over the replicate axis (one all-reduce).
            return [jnp.mean(x, axis=0) for x in local]
        axis = self.replica_axis
        body = quantized_mean(self.quantize, axis, self.replicas)
        held = [P(axis, *s) for s in specs]
        return jax.shard_map(body, mesh=self.mesh, in_specs=(specs, held), out_specs=specs)(
            params, local
        )

    def outer_step(self, params: PyTree, mean: PyTree, outer_state: PyTree) -> tuple[PyTree, Any]:
        """The global params and outer state after a sync: ``outer`` stepped with the
        pseudo-gradient ``params - mean`` (``mean``: the replicas' mean params)."""
        delta = jax.tree_util.tree_map(jnp.subtract, params, mean)
        updates, outer_state = self.outer.update(delta, outer_state, params)
        return optax.apply_updates(params, updates), outer_state


@dataclass(frozen=True, kw_only=True)
class LocalSGD(DiLoCo):
    """Replicas take ``every`` steps on their own params, then average them.

    :class:`DiLoCo` with the outer step ``params = mean(local)`` (``outer=optax.sgd(1.0)``
    up to rounding, computed as the mean itself), torch's ``PostLocalSGDOptimizer`` /
    ``LocalSGD`` model averaging. ``every=1`` with an inner optimizer linear in the
    gradients (SGD, with or without momentum) is DDP's training.

    Args:
        inner: how the gradients are averaged within a replica every step (as
            :class:`DiLoCo`'s). Default ``DDP()``.
        every: the steps between two averages of the replicas' params (a positive int).

    Example (8 devices: 8 replicas of one device)::

        >>> trainer = dp.Trainer(loss_fn, optax.sgd(0.1, momentum=0.9),
        ...                      layout=dp.Layout(replicate=8), sync=dp.sync.LocalSGD(every=4))
    """

    grad_route: ClassVar[str] = (
        "averaged within each replica every step, the params across replicas every few "
        "steps (LocalSGD)"
    )

    outer: optax.GradientTransformation = field(default=AVERAGE, init=False, repr=False)

    def outer_step(self, params: PyTree, mean: PyTree, outer_state: PyTree) -> tuple[PyTree, Any]:
        """The replicas' mean params, the outer state unchanged."""
        return mean, outer_state
