"""dp.Trainer: DDP for JAX. Replicate the model, split the global batch, average once.

A thin facade: it checks its arguments, binds its layout once (:class:`~jaxcoll.dp.BoundLayout`,
kept whole as ``trainer.layout``), prepares the gradient-sync strategy it is given (``sync=``,
:mod:`jaxcoll.dp.sync`), builds the jitted programs (:mod:`jaxcoll.dp.step.build`) and takes
its host loop from :mod:`jaxcoll.dp.loop.fit` (``Trainer.fit`` is :func:`loop.fit`). Where it
places batches and state, and the check of a state's placement, are its base's (``_placement.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from ..._core.checks import check_static_int
from ..._core.scheduled import Scheduled
from ..._core.typing import PyTree
from ..._watch import process, watchdog
from ..adapters import Model, annotated
from ..checks import (
    LossOutputError,
    check_flag,
    check_state,
    float_params,
    removed_keywords,
    unbound_axis,
)
from ..data.batches import Batches
from ..extra import Extra
from ..host import to_host
from ..layout import BoundLayout, Layout
from ..loop import fit as loop
from ..specs import from_rules, is_rules, model_specs, unbox
from ..state import TrainState
from ..step.build import build_eval, build_step
from ..step.loss import LossFn, check_optimizer, step_loss
from ..step.placement import first_state
from ..sync import Strategy
from ..sync.choose import for_layout
from ._placement import _Placement, _Specs

#: What ``Trainer(axis_name=)`` became: the layout names the data axes.
AXIS_NAME_GONE = (
    "name the data axes in the layout: layout=dp.Layout(replicate='data') with mesh= your "
    "mesh (a tuple of axes: dp.Layout(replicate=('node', 'local'))), or "
    "dp.Layout(shard='data') for FSDP or ZeRO-1 over it"
)


class Trainer(_Placement):
    """Data-parallel training over a mesh axis, equal to one device stepping the whole batch.

    Each step is equivalent to this single-device reference::

        def step(state, batch):                     # batch: the GLOBAL batch
            (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, rng)
            updates, opt_state = optimizer.update(g, state.opt_state, state.params)
            return state.replace(params=optax.apply_updates(state.params, updates), ...)

    It runs as one jitted, buffer-donating program: a ``jax.shard_map`` (checking on,
    ``check_vma=True``, for every strategy and algorithm) with the batch split over the
    layout's data axes, then the optimizer update. Each rank takes the gradient
    of its local mean loss with respect to params made *varying* (``lax.pcast``), so
    ``jax.grad`` inserts no reduction of its own; the local gradients are then synchronised
    exactly once by the gradient-sync strategy ``sync`` (:mod:`jaxcoll.dp.sync`):
    :class:`~jaxcoll.dp.sync.DDP` (the default: one all-reduce per bucket, every rank applies
    the same update), :class:`~jaxcoll.dp.sync.ZeRO1` (1/n of the optimizer state per
    device) or :class:`~jaxcoll.dp.sync.FSDP` (1/n of the params too). The model state
    (BatchNorm statistics) is averaged over the ranks every step, so it stays identical on
    every device even for a plain (unsynchronised) BatchNorm.

    Args:
        loss_fn: ``loss_fn(params, batch, rng) -> (loss, metrics)``: the per-example *mean*
            loss on a batch (a scalar) and a dict of scalar metrics (per-example means too,
            e.g. accuracy). ``rng`` is None in :meth:`evaluate`. If it takes a keyword
            argument ``step``, it gets the number of steps taken before this one (an int32
            scalar: schedules, warm-ups). Or a :class:`~jaxcoll.dp.Model` adapter
            (:class:`~jaxcoll.dp.Linen`, :class:`~jaxcoll.dp.Nnx`) for flax models with state.
            Checked when the step is traced: anything else raises, naming the fix.
        optimizer: an ``optax.GradientTransformation`` (schedules, ``chain``,
            ``apply_if_finite``, ...), or an ``optax.MultiSteps``, whose accumulation over
            successive *steps* (one update every k calls) is kept; ``accum_steps=k`` is the
            cheaper way when the k micro-batches come in one global batch.
        mesh: the device mesh, for a ``layout`` that names its axes' roles (or none: the
            batch is split over the mesh's axis ``"data"``); default: the layout's own mesh
            when it gives degrees (``dp.Layout(shard=4, tensor=2)``), else every device on
            one axis ``"data"``. A mesh with Explicit axes (``jax.make_mesh``'s default) is
            used with Auto axes over the same devices (``trainer.mesh``): the Trainer places
            its arrays itself. The data axes are the layout's:
            ``Trainer(..., mesh=m, layout=dp.Layout(replicate="data"))`` (``axis_name=`` is
            gone; it raises TypeError naming this).
        sync: the gradient-sync strategy: *how* the data axes hold the state (the layout
            says *which* they are), a value that carries its own options:
            ``dp.sync.DDP(bucket_mb=25.0, algorithm="auto", hook=None)`` (torch's
            ``DistributedDataParallel``; ``hook`` is ``register_comm_hook``: e.g.
            ``dp.hooks.Compress(jnp.bfloat16)``, ``dp.hooks.PowerSGD(rank=4)``),
            ``dp.sync.ZeRO1()`` (``ZeroRedundancyOptimizer``) or ``dp.sync.FSDP()``
            (``FullyShardedDataParallel``). Default: the layout's (FSDP over its ``shard``
            role, HSDP with ``replicate`` beside it; DDP without one). The Trainer prepares it
            for ``optimizer`` and its bound layout (``trainer.sync`` is the prepared copy).
        accum_steps: split the global batch into this many micro-batches, micro-batch ``j``
            its rows ``j, j + accum_steps, j + 2 * accum_steps, ...`` (each device takes its
            own rows among them; nothing moves), whose gradients are averaged locally and
            synchronised once (DDP's ``no_sync``), with ``accum_steps`` times smaller
            activations. The micro-batches are the same rows on every layout and process
            count, so whatever is computed over a whole micro-batch (SyncBatchNorm's
            statistics, an MoE load-balancing loss) equals one device's. Without
            batch-dependent layers this is the same update as the whole batch at once. With
            BatchNorm it is not: each micro-batch is normalised with its own statistics (over
            ``batch / accum_steps`` examples, across devices with SyncBatchNorm; over
            ``batch / (n * accum_steps)`` per device with a plain BatchNorm), and the running
            statistics are updated ``accum_steps`` times per step, micro-batch after
            micro-batch (torch's passes under ``no_sync`` chunk each rank's own rows instead,
            so there the grouping changes with the world size).
        extra: state carried and updated once per step besides the optimizer's
            (:class:`~jaxcoll.dp.Extra`), in ``state.extra``; e.g. ``dp.ema(0.999)``, an
            exponential moving average of the params.
        skip_nonfinite: a step whose loss or synchronised gradients hold an inf or NaN
            changes nothing (params, optimizer state, model state, extra, hook state) but
            the step count, and reports ``skipped=1.0`` in its metrics (0.0 otherwise).
            ``optax.apply_if_finite`` works too; it guards only the params and the optimizer
            state.
        donate: donate the state's buffers to the step (the caller's old state is consumed).
        layout: every role of the mesh (:class:`~jaxcoll.dp.Layout`): data replicas and
            shards, a tensor axis the model's tensor-parallel layers split over, a pipeline
            axis of stages and its schedule. Each param keeps its split over the model axes
            (its *model spec*, given to :meth:`init`) and the strategy splits it further over
            the data axes; the batch is replicated over the model axes. While the step is
            traced, the names model code uses (the roles ``"tensor"``, ``"pipeline"``; the
            logical axes ``"heads"``, ``"mlp"``, ``"layers"``, ...) stand for the layout's
            axes. Default: every device a data replica (data parallelism alone). The Trainer
            binds it to the mesh once and keeps it whole: ``trainer.layout`` is the
            :class:`~jaxcoll.dp.BoundLayout` (its mesh, data axes, batch split, the names
            model code uses, the schedule), which every part of the step asks.

    Example (8 devices)::

        >>> def loss_fn(w, batch, rng):
        ...     err = batch["x"] @ w - batch["y"]
        ...     return jnp.mean(err ** 2), {}
        >>> trainer = Trainer(loss_fn, optax.sgd(0.1), sync=dp.sync.ZeRO1())
        >>> state = trainer.init(jnp.zeros(3), jax.random.key(0))
        >>> state, metrics = trainer.step(state, {"x": np.ones((16, 3)), "y": np.ones(16)})
    """

    @removed_keywords(axis_name=AXIS_NAME_GONE)
    def __init__(
        self,
        loss_fn: LossFn | Model,
        optimizer: optax.GradientTransformation | optax.MultiSteps,
        *,
        mesh: Mesh | None = None,
        sync: Strategy | None = None,
        accum_steps: int = 1,
        extra: Extra | None = None,
        skip_nonfinite: bool = False,
        donate: bool = True,
        layout: Layout | None = None,
    ) -> None:
        api = "Trainer"
        self.model, self._loss = step_loss(api, loss_fn)
        self.optimizer = check_optimizer(api, optimizer)
        if extra is not None and not isinstance(extra, Extra):
            raise TypeError(
                f"{api}: extra must be a dp.Extra(init, update) (e.g. dp.ema(0.999)), "
                f"got {type(extra).__name__} instead."
            )
        if layout is not None and not isinstance(layout, Layout):
            raise TypeError(
                f"{api}: layout must be a dp.Layout (e.g. dp.Layout(shard=4, tensor=2)), or "
                f"None, got {type(layout).__name__} instead."
            )
        self.layout: BoundLayout = (layout or Layout())._bind(api, mesh)
        self.sync = for_layout(api, self.layout, sync).prepare(self.optimizer, self.layout)
        accum_steps = check_static_int(api, "accum_steps", accum_steps)
        if accum_steps < 1:
            raise ValueError(f"{api}: accum_steps={accum_steps} must be at least 1.")
        self.accum_steps = accum_steps
        self.extra = extra
        self.skip_nonfinite = check_flag(api, "skip_nonfinite", skip_nonfinite)
        self.donate = check_flag(api, "donate", donate)
        self._specs: _Specs | None = None  # known at init (or from a state's placement)
        self._placed: Any = None  # the params the last step returned (their specs checked)
        self._returned: Any = lambda: None  # the state the last step returned (weakly)
        self._step_fns: dict[Any, Any] = {}
        self._known_step: tuple[Any, int] | None = None
        self._eval_fn: Scheduled | None = None

    @property
    def mesh(self) -> Mesh:
        """The device mesh: the bound layout's (``trainer.layout.mesh``)."""
        return self.layout.mesh

    # ---------------------------------------------------------------------------------- init
    def init(
        self,
        params: PyTree,
        rng: jax.Array,
        *,
        model_state: PyTree | None = None,
        per_rank: bool = False,
        specs: PyTree | None = None,
    ) -> TrainState:
        """Replicate params (and model state) from rank 0 and build the optimizer state.

        Like DDP's constructor, which broadcasts rank 0's parameters and buffers, so ranks
        that started from different values train one model. The params and the optimizer
        state are placed by the strategy: replicated (``dp.sync.DDP``), the optimizer state
        split like the params (``dp.sync.ZeRO1``: each device holds 1/n of every split
        leaf's state), or both split (``dp.sync.FSDP``).

        Args:
            params: the initial params. With ``per_rank=True`` every leaf has a leading axis
                of size n holding one (possibly different) copy per rank, as separate
                processes would; rank 0's copy is broadcast to all.
            rng: a PRNG key (new-style or raw ``uint32[2]``): the run's base key.
            model_state: non-trainable variables (BatchNorm statistics); with a
                :class:`~jaxcoll.dp.Model` adapter, what its ``init`` returned.
            per_rank: see ``params``.
            specs: each param's model spec, a ``PartitionSpec`` over the layout's axes (a
                tree shaped like ``params``), or partition rules: a list of ``(regex,
                PartitionSpec)`` pairs, the first whose regex matches a param's path
                (``"layers/0/attn/q/kernel"``) giving its spec (EasyLM's and t5x's
                ``match_partition_rules``). Default: from flax's boxes
                (``nn.with_partitioning``, ``nn.with_logical_partitioning``, as
                :mod:`jaxcoll.nn`'s layers declare their params; the params are unboxed),
                else from a :class:`~jaxcoll.dp.Nnx` model's variable metadata
                (``nnx.with_partitioning``, ``out_sharding=``), else from each leaf's
                ``NamedSharding``, else whole. A spec may name mesh axes, roles and logical
                axes (``"heads"``, ``"mlp"``; the layout's ``rules`` map more, e.g. a
                model's own mesh names: ``rules={"mp": "tensor", "fsdp": None}``); a name
                that is none of them raises, naming the rule to add. A role the layout
                does not give runs dense; a split over a mesh axis without a role raises.

        Returns:
            A :class:`TrainState` at step 0, placed on the mesh; ``state.extra`` is
            ``extra.init(params)`` when the Trainer has an ``extra``.

        Raises:
            TypeError: a leaf of ``params`` is not floating (an integer or a bool) or no
                array at all (a string, an object): every param is differentiated and
                updated; the message names the leaf and where such a value belongs instead.
                A leaf of ``specs`` that is not a ``PartitionSpec`` (a bare string
                ``"tensor"``: write ``P("tensor")``).
        """
        params, boxed, notes = unbox(params)
        float_params("Trainer.init", params, self.sync.grad_route)
        if is_rules(specs):
            specs = from_rules("Trainer.init", specs, params)
        if specs is None and boxed is None:
            specs = annotated(self.model, params)
        given, notes = (boxed, notes) if specs is None else (specs, None)
        self._set_model_specs(
            model_specs("Trainer.init", params, given, self.layout, notes), params
        )
        return first_state(
            self.sync,
            params,
            rng,
            model_state,
            per_rank=per_rank,
            extra=self.extra,
            model_axes=self.layout.axes,
        )

    # ---------------------------------------------------------------------------------- step
    def step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on a GLOBAL batch (NumPy or jax arrays, a pytree).

        The batch's leading axis is split over the devices (and into ``accum_steps``
        micro-batches); its size must be a multiple of ``n * accum_steps``, else ValueError.

        Returns:
            The new state (the old one's buffers are donated when ``donate=True``: using the
            old state again raises ValueError) and the metrics (``loss`` and the loss_fn's
            metrics), averaged over the global batch, as device arrays (the step is
            asynchronous until you read them).
        """
        api = "Trainer.step"
        if state is not self._returned():  # the state the last step returned is live
            check_state(api, state)
        if state.params is not self._placed:  # a state this Trainer did not just return
            self._check_placed(api, state.params)
        batch = self.shard_batch(batch)
        phased = self.sync.phased
        host = self._host_step(state) if phased else None
        new, metrics = self._run(api, self._step_program(state, host), state, batch)
        if host is not None:  # phased
            self._known_step = (new.step, host + 1)
        self._placed = new.params  # placed by the step itself: its model specs are known
        self._returned = weakref.ref(new)
        return new, metrics

    def _step_program(self, state: TrainState, host_step: int | None = None):
        """The step program for ``state``: one per phase of the strategy
        (:meth:`~jaxcoll.dp.sync.Strategy.phase`; a strategy that is not ``phased`` has
        one), chosen from the step number on the host (``host_step``, or
        :meth:`_host_step`, read only for a phased strategy)."""
        sync, key = self.sync, None
        if sync.phased:
            sync = key = sync.phase(self._host_step(state) if host_step is None else host_step)
        if key not in self._step_fns:
            self._step_fns[key] = Scheduled(
                build_step(
                    self._loss,
                    sync,
                    state,
                    self.layout,
                    accum_steps=self.accum_steps,
                    donate=self.donate,
                    extra=self.extra,
                    skip_nonfinite=self.skip_nonfinite,
                )
            )
        return self._step_fns[key]

    def _host_step(self, state: TrainState) -> int:
        """``state.step`` as an int: known without a device read for a state this Trainer
        returned last; read (waiting for it) otherwise, e.g. after a restore."""
        known = self._known_step
        if known is not None and known[0] is state.step:
            return known[1]
        return int(jax.device_get(state.step))

    def _run(self, api: str, program: Any, *args: Any) -> Any:
        """``program(*args)``, with the user's mistakes found while tracing it explained;
        handed to the collective watchdog when a timeout is set (:mod:`jaxcoll._watch`)."""
        try:
            out = program(*args)
            if process.settings.on:  # watched (a peer hangs: one line, an exit) and recorded
                watchdog.register(out[1] if isinstance(out, tuple) else out, api, args[-1])
            return out
        except LossOutputError as e:
            raise e.kind(f"{api}: {e.message}") from None
        except (NameError, AssertionError) as e:
            axis = unbound_axis(e, tuple(self.mesh.axis_names))
            if axis is None:
                raise
            data = self.layout.axis_name
            raise ValueError(
                f"{api}: the model reduces over axis_name={axis!r} (a BatchNorm or "
                f"SyncBatchNorm built with axis_name={axis!r}?), but this Trainer splits the "
                f"batch over axis_name={data!r}, the only axis its step binds. Build the "
                f"layer with axis_name={data!r} (dp.SyncBatchNorm() does for 'data'), or the "
                f"Trainer with layout=dp.Layout(replicate={axis!r}) and a mesh with that axis."
            ) from e

    def step_program(
        self, state: TrainState, batch: PyTree, *, step: int | None = None
    ) -> tuple[Any, tuple[Any, Any]]:
        """The jitted step program and abstract arguments to lower, compile or export it.

        ``step``: the step number (``state.step`` before the step) whose program to return,
        for a strategy with one program per phase (``sync.phased``, e.g. PowerSGD's plain
        steps before ``start_iter``); None: ``state``'s own (read from the device unless this
        Trainer returned ``state``).

        Returns:
            ``(step, (state_spec, batch_spec))``: :meth:`step`'s jitted function
            ``step(state, batch) -> (state, metrics)`` and ``jax.ShapeDtypeStruct`` trees with
            the shardings the step receives, e.g. for
            ``jax.export.export(step, platforms=("cuda",))(*args)`` or
            ``step.lower(*args).compile(compiler_options=jaxcoll.compiler_options())`` (the
            executable :meth:`step` runs: a plain ``jax.jit``, compiled with jaxcoll's XLA
            options). Nothing is run or transferred.
        """
        check_state("Trainer.step_program", state)
        self._check_batch(batch, "Trainer.step")
        batch_sharding = self.batch_sharding

        def of_state(x):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding)

        def of_batch(x):
            # a jax array's own dtype (np.result_type of one is deprecated); NumPy's or a scalar's
            dtype = jax.dtypes.canonicalize_dtype(
                x.dtype if hasattr(x, "dtype") else np.result_type(x)
            )
            return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=batch_sharding)

        args = (jax.tree_util.tree_map(of_state, state), jax.tree_util.tree_map(of_batch, batch))
        if step is not None:
            step = check_static_int("Trainer.step_program", "step", step)
        return self._step_program(state, step).jitted, args

    # ------------------------------------------------------------------------------ evaluate
    def evaluate(self, state: TrainState, data: Batches | Iterable[PyTree]) -> dict[str, float]:
        """The exact mean of ``loss`` and every metric over every example in ``data``.

        ``data`` is an iterable of global batches of any sizes, or a
        :class:`~jaxcoll.dp.Batches` (every example once, in order, whatever its
        ``shuffle`` and ``drop_last``). The loss_fn runs with ``rng=None`` (no dropout;
        adapters use BatchNorm's running statistics). A batch that does not split over the
        n devices is evaluated as its largest part that does, then its last ``m % n``
        examples given whole to every device; each part weighted by its size. So the result
        is the per-example mean over all of ``data`` for every metric that is a per-example
        mean on its batch, as the loss_fn's metrics must be. Evaluate other params (an EMA)
        with ``evaluate(state.replace(params=...), data)``.
        """
        api = "Trainer.evaluate"
        check_state(api, state)
        self._check_placed(api, state.params)
        if self._eval_fn is None:
            self._eval_fn = Scheduled(build_eval(self._loss, self.sync, state.params, self.layout))
        eval_fn = self._eval_fn
        return loop.evaluate(
            lambda b: self._run(
                api, eval_fn, state.params, state.model_state, state.step, self.shard_batch(b, api)
            ),
            data,
            self.layout.n,
        )

    # ----------------------------------------------------------------------------------- fit
    # The host loop: its signature, options and docstring are written once, in dp/loop/fit.py.
    fit = loop.fit

    # ------------------------------------------------------------------------- host copies
    def host_params(self, state: TrainState) -> PyTree:
        """The params of ``state`` as whole NumPy arrays on the host, on every process.

        ``jax.device_get(state.params)`` works in one process; in a multi-process job whose
        params are split over the processes' devices (``sync=dp.sync.FSDP()``) it raises
        (an array that "spans non-addressable devices"). This gathers each such leaf with
        ``jax.experimental.multihost_utils.process_allgather`` and reads the others locally;
        every process gets the same whole params, bit-identical to a single-process read.

        .. warning:: Collective in a multi-process job: every process must call it at the
           same point (as ``torch.distributed``'s ``FSDP.state_dict`` under
           ``FULL_STATE_DICT``); a call under ``if jax.process_index() == 0:`` waits for the
           other processes for ever (the watchdog ends it). Each device briefly holds the
           whole params.

        Returns:
            The params tree with ``numpy.ndarray`` leaves (independent of ``state``).

        Example (any number of processes)::

            >>> params = trainer.host_params(state)      # on every process
            >>> if jax.process_index() == 0:
            ...     np.savez("params.npz", **params)
        """
        check_state("Trainer.host_params", state)
        return to_host(state.params)

    def to_module(self, state: TrainState) -> Any:
        """The trained model in its framework's form, on the default device, independent of
        ``state`` (a later step may donate the state's buffers).

        :class:`~jaxcoll.dp.Nnx`: a new nnx module with the trained params and BatchNorm
        statistics (call ``.eval()`` on it for inference); :class:`~jaxcoll.dp.Linen`: the
        module bound to the trained variables (``bound(x, train=False)``). The params are
        read as :meth:`host_params` reads them, so in a multi-process job it is collective
        too: every process calls it, and each gets the whole model.
        """
        api = "Trainer.to_module"
        check_state(api, state)
        if self.model is None:
            raise TypeError(
                f"{api}: this Trainer trains a plain loss_fn, which has no module; "
                f"its trained params are state.params (whole on the host: "
                f"trainer.host_params(state))."
            )
        params, model_state = jax.device_put(to_host((state.params, state.model_state)))
        return self.model.to_module(params, model_state)
