"""The interface every gradient-sync strategy offers: a configuration value, prepared once,
then called by the step builder (optax-like).

A strategy is a value the user writes: ``dp.Trainer(..., sync=dp.sync.FSDP())``. Its fields
are its configuration, checked when it is constructed; it holds no state (state lives in
pytrees: the optimizer state, the hook state), so one is safe to share and to rebuild.
:meth:`Strategy.prepare` returns a copy prepared for the optimizer and the Trainer's bound
layout (:class:`~jaxcoll.dp.BoundLayout`: its mesh, its data axes, its shard axis); the Trainer
prepares its ``sync`` once, and the step builder (:mod:`jaxcoll.dp.step.build`) calls the
prepared copy. A strategy turns per-rank *local* gradients into one optimizer step, in two halves
around the step's ``jax.shard_map``, plus the placement both halves need:

* :meth:`Strategy.init` builds the optimizer state, placed on the mesh (its placement is the
  strategy's: replicated for :class:`~jaxcoll.dp.sync.DDP`, 1/n per device for
  :class:`~jaxcoll.dp.sync.ZeRO1` and :class:`~jaxcoll.dp.sync.FSDP`);
  :meth:`Strategy.init_comm` the communication hook's state (one per bucket and rank);
* :meth:`Strategy.loss_of_held` runs per rank inside ``shard_map`` and turns the loss of the
  whole params into a loss of the params as the train state holds them
  (:meth:`state_param_specs`: replicated, or 1/n per device for FSDP, which gathers them);
* :meth:`Strategy.reduce` runs per rank inside ``shard_map`` (checking on) and returns the
  synchronised gradients, laid out as :meth:`Strategy.grad_specs` says (the shard_map's
  ``out_specs``), and the hook's new state;
* :meth:`Strategy.update` runs in ``jax.jit``'s global view, after the shard_map and inside
  the same program: ``update(grads, opt_state, params) -> (params, opt_state)``, the params
  placed as :meth:`state_param_specs` says;
* :meth:`Strategy.phase` gives the strategy that runs a given step, for a hook whose program
  changes with the step (:class:`~jaxcoll.dp.hooks.PhasedHook`); the Trainer compiles one
  program per phase and knows nothing of hooks.

A new strategy is one subclass here: a frozen dataclass with its own fields (checked in
``__post_init__``) that overrides the methods whose behaviour it changes.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..._core.typing import AxisName, PyTree
from ..._core.vma import axis_names
from ...algorithms.registry import check_algorithm
from ..hooks.base import AllReduceHook, CommHook, Compress, PhasedHook, check_hook, init_state
from ..layout import BoundLayout
from .buckets import plan_buckets
from .precision import MixedPrecisionPolicy, check_policy


def is_spec(x: Any) -> bool:
    return isinstance(x, P)


def specs_like(tree: PyTree, spec: P) -> PyTree:
    """``spec`` for every leaf of ``tree``."""
    return jax.tree_util.tree_map(lambda _: spec, tree)


def leaf_shape(leaf: Any) -> tuple[int, ...]:
    return tuple(getattr(leaf, "shape", np.shape(leaf)))


def mirror_specs(tree: PyTree, params: PyTree, param_specs: PyTree) -> PyTree:
    """The spec of every leaf of ``tree`` (an optimizer state, an EMA): a leaf that mirrors a
    param gets the param's spec in ``param_specs``, any other leaf ``P()``.

    A leaf mirrors a param when the param's path in the params tree ends its own path
    (``mu['l0']['w']`` ends with ``['l0']['w']``; the longest such path wins) and the shapes
    match; any other leaf (step counts, factored statistics) is replicated. The placement
    only decides memory: the update is exact with any placement.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    if not flat:
        return specs_like(tree, P())
    specs = jax.tree_util.tree_leaves(param_specs, is_leaf=is_spec)
    rows = zip(flat, specs, strict=True)
    table = sorted(
        ((tuple(path), leaf_shape(leaf), spec) for (path, leaf), spec in rows),
        key=lambda row: -len(row[0]),
    )

    def spec_of(path, leaf):
        path, shape = tuple(path), leaf_shape(leaf)
        for p_path, p_shape, spec in table:
            k = len(p_path)
            if k <= len(path) and path[len(path) - k :] == p_path and shape == p_shape:
                return spec
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, tree)


class Prepared(NamedTuple):
    """What :meth:`Strategy.prepare` fixes: the optimizer and the bound layout (the mesh, its
    data axes, its shard axis); and, once the params are known, their model specs
    (:meth:`Strategy.with_model_specs`)."""

    optimizer: optax.GradientTransformation
    layout: BoundLayout
    model_specs: tuple[P, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """Base of the gradient-sync strategies: the shared configuration, the preparation and
    the placement code.

    Attributes:
        bucket_mb: bucket size in MiB for the all-reduced gradients (DDP's
            ``bucket_cap_mb``); None: one collective per leaf (bucketing off).
        algorithm: the collective algorithm, passed through to jaxcoll's primitives:
            ``"auto"``, ``"native"`` (one lax collective), ``"ring"``, ``"tree"`` or
            ``"hierarchical"`` (with a tuple ``axis_name``).
        hook: the communication hook each bucket goes through (:mod:`jaxcoll.dp.hooks`,
            DDP's ``register_comm_hook``); None: DDP's default, the exact mean in the
            gradients' own dtype.
        mp_policy: the mixed precision policy (:class:`~jaxcoll.dp.sync.MixedPrecisionPolicy`,
            torch FSDP2's ``mp_policy``): the dtype the loss computes with (the params cast
            to it on their way to the loss; FSDP casts each slice before its all-gather)
            and the dtype the gradients are reduced in; the params and the optimizer state
            stay in their own dtype. None: no cast. Not with ``hook``.

    Raises:
        TypeError, ValueError: a field has a wrong type or value (at construction); the
            message names the class, the field, the value and the fix.
    """

    #: How a param's gradient crosses the devices, as error messages say it.
    grad_route: ClassVar[str] = "synchronised over the devices"

    bucket_mb: float | None = 25.0
    algorithm: str = "auto"
    hook: CommHook | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    _prepared: Prepared | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        api = self.api
        mb = self.bucket_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, numbers.Real)):
            raise TypeError(
                f"{api}: bucket_mb must be a number of MiB or None, got {mb!r} of "
                f"type {type(mb).__name__} instead."
            )
        if mb is not None and not (mb > 0 and np.isfinite(mb)):
            raise ValueError(
                f"{api}: bucket_mb={mb!r} must be a positive number of MiB, or "
                f"None to turn bucketing off."
            )
        check_algorithm(api, self.algorithm)
        check_hook(api, self.hook)
        check_policy(api, self.mp_policy, self.hook)

    @property
    def api(self) -> str:
        """The strategy's name in messages: ``dp.sync.DDP``, ..."""
        return f"dp.sync.{type(self).__name__}"

    # -------------------------------------------------------------------------- preparation
    def prepare(self, optimizer: optax.GradientTransformation, layout: BoundLayout) -> Strategy:
        """A copy of this strategy prepared for ``optimizer`` and the bound ``layout``
        (:meth:`dp.Layout.bind <jaxcoll.dp.Layout.bind>`: the mesh, the data axes the
        gradients are averaged over, the shard axis): what the step builder calls.
        ``dp.Trainer`` prepares its ``sync`` once, when it is built."""
        prepared = Prepared(optimizer, layout)
        self.check_prepared(prepared)
        out = copy.copy(self)
        object.__setattr__(out, "_prepared", prepared)
        return out

    def check_prepared(self, prepared: Prepared) -> None:
        """Check the fields against what :meth:`prepare` fixes (the layout's axes): called by
        :meth:`prepare` and by :meth:`replace` on a prepared strategy. Nothing here."""

    def _ready(self) -> Prepared:
        if self._prepared is None:
            raise RuntimeError(
                f"{self.api}: this strategy is not prepared for an optimizer and a layout "
                f"yet; pass it to dp.Trainer(..., sync=...), or call "
                f".prepare(optimizer, dp.Layout(...).bind(mesh)) for a prepared copy."
            )
        return self._prepared

    def with_model_specs(self, specs: tuple[P, ...] | None) -> Strategy:
        """A copy prepared as this one is, for params whose leaves carry the model specs
        ``specs`` (:mod:`jaxcoll.dp.specs`: their split over the tensor and pipeline axes,
        one ``PartitionSpec`` per leaf, in leaf order; None: every leaf whole). The strategy
        places each leaf over the data axes on top of its model spec."""
        out = copy.copy(self)
        object.__setattr__(out, "_prepared", self._ready()._replace(model_specs=specs))
        return out

    def model_leaf_specs(self, tree: PyTree) -> list[P]:
        """The model spec of every leaf of ``tree`` (shaped like the params), in leaf order:
        ``P()`` for each when the preparation has none."""
        count = len(jax.tree_util.tree_leaves(tree))
        specs = self._ready().model_specs
        if specs is None:
            return [P()] * count
        if len(specs) != count:
            raise ValueError(
                f"{self.api}: these params have {count} leaves, and the model specs the "
                f"strategy was prepared with have {len(specs)}; a Trainer trains one model "
                f"(pass the params it was initialised with)."
            )
        return list(specs)

    def held_axes(self, tree: PyTree) -> list[tuple[str, ...]]:
        """Per leaf of ``tree`` (shaped like the params), the data axes its model spec
        splits it over (an MoE's experts over the expert axis they borrow); () for most.
        Such a leaf is neither split further over those axes nor averaged over them: its
        local gradient already sums every token of its group (the all-to-all's backward
        brought them), so :meth:`reduce_held` sums it over the other data axes alone."""
        names = self._ready().layout.data_axes
        return [
            tuple(
                a
                for e in m
                if e is not None
                for a in (e if isinstance(e, tuple) else (e,))
                if a in names
            )
            for m in self.model_leaf_specs(tree)
        ]

    def reduce_held(self, grads: list[jax.Array], held: list[tuple[str, ...]]) -> list[jax.Array]:
        """Per rank: the gradients of leaves split over data axes (:meth:`held_axes`) ->
        their slices of the global mean, summed over the other data axes (one all-reduce
        each, in the policy's reduce dtype) and divided by every data rank's count."""
        names = axis_names(self.axis_name)
        wire = None if self.mp_policy is None else self.mp_policy.wire_dtype
        out = []
        for g, axes in zip(grads, held, strict=True):
            rest = tuple(a for a in names if a not in axes)
            g = g / np.asarray(self.n, g.dtype)
            if rest:
                # Gradients cross devices here: summed over the data axes the leaf is whole on.
                moved = g if wire is None else g.astype(wire)
                g = jax.lax.psum(moved, rest).astype(g.dtype)
            out.append(g)
        return out

    def reduce_held_leaves(
        self, leaves: list[jax.Array], held: list[tuple[str, ...]]
    ) -> tuple[list[jax.Array], list[int]]:
        """``leaves`` (the gradients, in leaf order) with those split over a data axis
        reduced by :meth:`reduce_held`, and the indices of the others, left for the
        strategy's own collectives."""
        out = list(leaves)
        split = [i for i, h in enumerate(held) if h]
        reduced = self.reduce_held([leaves[i] for i in split], [held[i] for i in split])
        for i, g in zip(split, reduced, strict=True):
            out[i] = g
        return out, [i for i, h in enumerate(held) if not h]

    def model_specs(self, tree: PyTree) -> PyTree:
        """:meth:`model_leaf_specs` as a tree shaped like ``tree``."""
        treedef = jax.tree_util.tree_structure(tree)
        return jax.tree_util.tree_unflatten(treedef, self.model_leaf_specs(tree))

    @property
    def optimizer(self) -> optax.GradientTransformation:
        """The ``optax.GradientTransformation`` the strategy steps (prepared)."""
        return self._ready().optimizer

    @property
    def layout(self) -> BoundLayout:
        """The Trainer's bound layout (prepared)."""
        return self._ready().layout

    @property
    def mesh(self) -> Mesh:
        """The device mesh (prepared)."""
        return self._ready().layout.mesh

    @property
    def axis_name(self) -> AxisName:
        """The data axis (or tuple of axes) of :attr:`mesh` the gradients are averaged over
        (prepared)."""
        return self._ready().layout.axis_name

    @property
    def n(self) -> int:
        """The number of ranks the gradients are averaged over (prepared): the devices of
        every data axis."""
        return int(np.prod([self.mesh.shape[a] for a in axis_names(self.axis_name)]))

    @property
    def bucket_bytes(self) -> float | None:
        """:attr:`bucket_mb` in bytes."""
        return None if self.bucket_mb is None else float(self.bucket_mb) * 2**20

    @property
    def bucket_hook(self) -> CommHook:
        """The hook each bucket goes through: :attr:`hook`; with a :attr:`mp_policy` that
        reduces in a dtype of its own, :class:`~jaxcoll.dp.hooks.Compress` to it; else DDP's
        default."""
        if self.hook is not None:
            return self.hook
        wire = None if self.mp_policy is None else self.mp_policy.wire_dtype
        return AllReduceHook() if wire is None else Compress(wire)

    # ------------------------------------------------------------------------------- phases
    @property
    def phased(self) -> bool:
        """Whether the step program depends on the step number (a hook with phases)."""
        return isinstance(self.hook, PhasedHook)

    def phase(self, step: int) -> Strategy:
        """The strategy that runs step ``step`` (known on the host), prepared as this one is: a
        hashable value, one compiled program each. Itself when not :attr:`phased`."""
        hook = self.hook
        if not isinstance(hook, PhasedHook):  # not self.phased
            return self
        return self.replace(hook=hook.phase(step))

    def replace(self, **changes: Any) -> Strategy:
        """A copy with ``changes`` to its fields (checked again), prepared as this one is."""
        new = dataclasses.replace(self, **changes)
        if self._prepared is not None:
            new.check_prepared(self._prepared)
        object.__setattr__(new, "_prepared", self._prepared)
        return new

    def named(self, specs: PyTree) -> PyTree:
        """``NamedSharding`` on the strategy's mesh for every ``PartitionSpec`` in ``specs``."""
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=is_spec)

    # ---------------------------------------------------------------------------- placement
    def state_param_specs(self, params: PyTree) -> PyTree:
        """Where the train state holds each param between steps: as its model spec says
        (:meth:`model_specs`; replicated without a layout) by default."""
        return self.model_specs(params)

    def held(self, params: PyTree, opt_state: PyTree) -> PyTree:
        """Global view: the params the step's per-rank loss differentiates, as the step's
        ``shard_map`` receives them (placed as :meth:`held_specs` says): ``params`` (the
        train state's) by default; a semi-synchronous strategy's replicas' own params
        (:class:`~jaxcoll.dp.sync.DiLoCo`: from its optimizer state)."""
        return params

    def held_specs(self, params: PyTree) -> PyTree:
        """The ``shard_map`` in_specs of :meth:`held`: :meth:`state_param_specs` by
        default."""
        return self.state_param_specs(params)

    def own_held(self, held: PyTree) -> PyTree:
        """Per rank, inside the step's ``shard_map``: this rank's block of :meth:`held` ->
        the params as :meth:`loss_of_held` takes them (the train state's layout): the block
        itself by default."""
        return held

    def extra_specs(self, extra: PyTree, params: PyTree) -> PyTree:
        """Where the train state holds ``extra`` (:class:`~jaxcoll.dp.Extra`): each leaf that
        mirrors a param placed like the param in the state (:func:`mirror_specs`), the
        others replicated."""
        return mirror_specs(extra, params, self.state_param_specs(params))

    def param_specs(self, params: PyTree) -> PyTree:
        """Where the optimizer sees each param (and its gradient): as its model spec says
        by default."""
        return self.model_specs(params)

    def grad_specs(self, params: PyTree) -> PyTree:
        """The layout :meth:`reduce` returns the gradients in (the shard_map's out_specs)."""
        return self.param_specs(params)

    def opt_specs(self, opt_state: PyTree, params: PyTree) -> PyTree:
        """The placement of every optimizer-state leaf: each leaf that mirrors a param is
        placed as the optimizer sees the param (:meth:`param_specs`), the others replicated
        (:func:`mirror_specs`)."""
        return mirror_specs(opt_state, params, self.param_specs(params))

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
            jax.lax.with_sharding_constraint(p, shardings)
        )
        return jax.jit(init, out_shardings=self.opt_shardings(params))(params)

    def init_comm(self, params: PyTree) -> PyTree:
        """The hook's state for the gradients of ``params``: ``{}`` for a stateless hook,
        else a list with one state per bucket, every leaf stacked per rank (a leading axis
        of n, split over the data axis: each device holds its own rank's state)."""
        leaves = jax.tree_util.tree_leaves(params)
        shapes = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
        states = [
            init_state(self.bucket_hook, [shapes[i] for i in bucket], k)
            for k, bucket in enumerate(plan_buckets(shapes, self.bucket_bytes))
        ]
        if not jax.tree_util.tree_leaves(states):
            return {}
        n = self.n

        def stack(tree):
            return jax.tree_util.tree_map(
                lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (n, *np.shape(x))), tree
            )

        sharding = NamedSharding(self.mesh, P(self.axis_name))
        return jax.jit(lambda: stack(states), out_shardings=sharding)()

    def loss_of_held(self, fn: Callable[..., Any], like: PyTree) -> Callable[..., Any]:
        """Per rank, inside ``shard_map``: ``fn(params, model_state, batch, *rest)``, the loss
        of the whole params, as a function of the params as the train state holds them, for
        ``jax.grad`` (here the params are held whole: ``fn`` itself, its params and batch
        cast as :attr:`mp_policy` says). ``like``: the params' global shapes
        (``jax.ShapeDtypeStruct``)."""
        return self.compute(fn)

    def compute(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its params and batch cast as :attr:`mp_policy` says (``fn`` itself
        without a policy)."""
        return fn if self.mp_policy is None else self.mp_policy.compute(fn)

    def reduce(
        self, grads: PyTree, comm_state: PyTree, step: jax.Array, like: PyTree = None
    ) -> tuple[PyTree, PyTree]:  # pragma: no cover - interface
        """Per rank, inside ``shard_map``: the local gradients -> the synchronised ones,
        and the hook's new state (``comm_state``: this rank's own state). ``like``: the
        params' global shapes; ``step``: the steps taken before this one."""
        raise NotImplementedError

    def update(
        self, grads: PyTree, opt_state: PyTree, params: PyTree
    ) -> tuple[PyTree, PyTree]:  # pragma: no cover - interface
        """Global view, inside the step's jit: ``(new params, new opt_state)``, the params
        placed as :meth:`state_param_specs` says."""
        raise NotImplementedError
