"""dp.Trainer: DDP for JAX. Replicate the model, split the global batch, average once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import primitives
from .._core.checks import check_static_int
from .._core.typing import AxisName, PyTree
from ._loop import batch_source, finish_history, total_steps
from ._vma import axis_names, is_varying, to_varying
from .adapters import Model
from .grad_sync import (
    FlatLayout,
    algorithm_kwargs,
    all_gather_params,
    mean_gradients,
    reduce_scatter_mean,
)
from .state import TrainState

LossFn = Callable[[PyTree, PyTree, jax.Array | None], tuple[jax.Array, dict[str, jax.Array]]]


class Trainer:
    """Data-parallel training over a mesh axis, equal to one device stepping the whole batch.

    Each step is equivalent to this single-device reference::

        def step(state, batch):                     # batch: the GLOBAL batch
            (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, rng)
            updates, opt_state = optimizer.update(g, state.opt_state, state.params)
            return state.replace(params=optax.apply_updates(state.params, updates), ...)

    It runs as one jitted, buffer-donating ``jax.shard_map`` program: params replicated
    (``P()``), the batch split over ``axis_name`` (``P(axis_name)``). Each rank takes the
    gradient of its local mean loss with respect to params made *varying* (``lax.pcast``),
    so ``jax.grad`` inserts no reduction of its own; the local gradients are then averaged
    exactly once by jaxcoll collectives, one per bucket of about ``bucket_mb`` MiB
    (:func:`~jaxcoll.dp.grad_sync.mean_gradients`), and every rank applies the same update.

    Args:
        loss_fn: ``loss_fn(params, batch, rng) -> (loss, aux)``: the per-example *mean* loss
            on a batch and a dict of scalar metrics (per-example means too, e.g. accuracy).
            ``rng`` is None in :meth:`evaluate`. Or a :class:`~jaxcoll.dp.Model` adapter
            (:class:`~jaxcoll.dp.Linen`, :class:`~jaxcoll.dp.Nnx`) for flax models with state.
        optimizer: an ``optax.GradientTransformation``.
        mesh: the device mesh; default: every device on one axis named ``axis_name``.
        axis_name: the mesh axis (or tuple of axes) the batch is split over.
        grad_sync: the all-reduce algorithm, passed through to jaxcoll's primitives:
            ``"auto"``, ``"native"`` (one lax collective), or ``"ring"``, ``"tree"``,
            ``"hierarchical"`` where the primitives offer them.
        bucket_mb: bucket size in MiB (DDP's ``bucket_cap_mb``); None: one collective per
            leaf (bucketing off).
        grad_dtype: the dtype gradients travel in (``jnp.bfloat16``: DDP's bf16 compression
            hook); the update itself stays in the params' dtype. None: the params' dtype.
        accum_steps: split each rank's share of the batch into this many micro-batches whose
            gradients are summed locally and synchronised once (DDP's ``no_sync``): the same
            update with ``accum_steps`` times smaller activations.
        donate: donate the state's buffers to the step (the caller's old state is consumed).
        shard_optimizer: ZeRO-1. Each rank keeps the optimizer state of 1/n of the params:
            gradients are reduce-scattered, each rank updates its shard, the params are
            all-gathered. Needs an element-wise optimizer (sgd, adam, adamw, ...): one that
            looks across params (``clip_by_global_norm``) would see only a shard.

    Example (8 devices)::

        >>> def loss_fn(w, batch, rng):
        ...     err = batch["x"] @ w - batch["y"]
        ...     return jnp.mean(err ** 2), {}
        >>> trainer = Trainer(loss_fn, optax.sgd(0.1))
        >>> state = trainer.init(jnp.zeros(3), jax.random.key(0))
        >>> state, metrics = trainer.step(state, {"x": np.ones((16, 3)), "y": np.ones(16)})
    """

    def __init__(
        self,
        loss_fn: LossFn | Model,
        optimizer: optax.GradientTransformation,
        *,
        mesh: Mesh | None = None,
        axis_name: AxisName = "data",
        grad_sync: str = "auto",
        bucket_mb: float | None = 25.0,
        grad_dtype: Any = None,
        accum_steps: int = 1,
        donate: bool = True,
        shard_optimizer: bool = False,
    ) -> None:
        api = "Trainer"
        if isinstance(loss_fn, Model):
            self.model: Model | None = loss_fn
            self._loss = loss_fn.loss_fn
        elif callable(loss_fn):
            self.model = None
            self._loss = _stateless(loss_fn)
        else:
            raise TypeError(f"{api}: loss_fn must be a callable loss_fn(params, batch, rng) or a "
                            f"dp.Model adapter, got {type(loss_fn).__name__} instead.")
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"{api}: optimizer must be an optax.GradientTransformation "
                            f"(e.g. optax.adam(1e-3)), got {type(optimizer).__name__} instead.")
        if mesh is None:
            if isinstance(axis_name, (tuple, list)):
                raise ValueError(f"{api}: axis_name={axis_name!r} names several axes; pass the "
                                 f"mesh that has them.")
            mesh = Mesh(np.array(jax.devices()), (axis_name,))
        names = axis_names(axis_name)
        missing = [a for a in names if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"{api}: axis_name={axis_name!r} is not an axis of the mesh "
                             f"(axes {mesh.axis_names}). Pass one of them.")
        if bucket_mb is not None and not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"{api}: bucket_mb={bucket_mb!r} must be a positive number of MiB, "
                             f"or None to turn bucketing off.")
        accum_steps = check_static_int(api, "accum_steps", accum_steps)
        if accum_steps < 1:
            raise ValueError(f"{api}: accum_steps={accum_steps} must be at least 1.")
        if grad_dtype is not None and not jnp.issubdtype(grad_dtype, jnp.floating):
            raise TypeError(f"{api}: grad_dtype must be a floating dtype such as jnp.bfloat16, "
                            f"got {grad_dtype!r} instead.")
        self.optimizer = optimizer
        self.mesh = mesh
        self.axis_name = names[0] if len(names) == 1 else names
        self.n = int(np.prod([mesh.shape[a] for a in names]))
        self.algorithm = algorithm_kwargs(api, grad_sync)
        self.grad_sync = grad_sync
        self.bucket_bytes = None if bucket_mb is None else float(bucket_mb) * 2**20
        self.grad_dtype = None if grad_dtype is None else jnp.dtype(grad_dtype)
        self.accum_steps = accum_steps
        self.donate = bool(donate)
        self.shard_optimizer = bool(shard_optimizer)
        self._layout: FlatLayout | None = None
        self._step_fn = None
        self._eval_fn = None

    # ----------------------------------------------------------------------------- placement
    def _sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def _state_specs(self, state: TrainState) -> TrainState:
        opt_spec = P(self.axis_name) if self.shard_optimizer else P()
        return TrainState(
            params=jax.tree_util.tree_map(lambda _: P(), state.params),
            opt_state=jax.tree_util.tree_map(lambda _: opt_spec, state.opt_state),
            model_state=jax.tree_util.tree_map(lambda _: P(), state.model_state),
            step=P(),
            rng=P(),
        )

    def shard_batch(self, batch: PyTree, api: str = "Trainer.step") -> PyTree:
        """Place a global batch on the mesh, split along its leading axis; check its size."""
        leaves = jax.tree_util.tree_leaves(batch)
        if not leaves:
            raise ValueError(f"{api}: the batch holds no array.")
        sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
        if None in sizes or len(sizes) != 1:
            raise ValueError(f"{api}: every array in the batch needs the same leading (example) "
                             f"axis, got leading sizes {sizes}.")
        size = sizes.pop()
        unit = self.n * (self.accum_steps if api == "Trainer.step" else 1)
        if size % unit:
            what = f"{self.n} devices" + (f" x accum_steps={self.accum_steps}"
                                          if unit != self.n else "")
            raise ValueError(
                f"{api}: the global batch has {size} examples, which does not split evenly over "
                f"{what} (a multiple of {unit} is needed); an uneven split would bias the "
                f"gradient mean. Drop the short batch (dp.Batches(..., drop_last=True)) or use a "
                f"batch size that is a multiple of {unit}."
            )
        return jax.device_put(batch, self._sharding(P(self.axis_name)))

    # ---------------------------------------------------------------------------------- init
    def init(
        self,
        params: PyTree,
        rng: jax.Array,
        *,
        model_state: PyTree | None = None,
        per_rank: bool = False,
    ) -> TrainState:
        """Replicate params (and model state) from rank 0 and build the optimizer state.

        Like DDP's constructor, which broadcasts rank 0's parameters and buffers, so ranks
        that started from different values train one model.

        Args:
            params: the initial params. With ``per_rank=True`` every leaf has a leading axis
                of size n holding one (possibly different) copy per rank, as separate
                processes would; rank 0's copy is broadcast to all.
            rng: a PRNG key (new-style or raw ``uint32[2]``): the run's base key.
            model_state: non-trainable variables (BatchNorm statistics); with a
                :class:`~jaxcoll.dp.Model` adapter, what its ``init`` returned.
            per_rank: see ``params``.

        Returns:
            A :class:`TrainState` at step 0, placed on the mesh.
        """
        model_state = {} if model_state is None else model_state
        if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
            rng = jax.random.key_data(rng)
        rng = jnp.asarray(rng, jnp.uint32)
        if rng.shape != (2,):
            raise ValueError(f"Trainer.init: rng must be a PRNG key, e.g. jax.random.key(0), got "
                             f"an array of shape {rng.shape} instead.")
        replicated = self._sharding(P())
        if per_rank:
            params, model_state = self._broadcast_from_rank0((params, model_state))
        else:
            # A copy: the step donates the state's buffers, and the caller's arrays must survive.
            copy = jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t),
                           out_shardings=replicated)
            params, model_state = copy((params, model_state))
        if self.shard_optimizer:
            self._layout = FlatLayout.of("Trainer", params, self.n, self.bucket_bytes)
            opt_state = self._init_sharded_opt(params)
        else:
            opt_state = jax.jit(self.optimizer.init, out_shardings=replicated)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
        return TrainState(params, opt_state, model_state, step, jax.device_put(rng, replicated))

    def _broadcast_from_rank0(self, tree: PyTree) -> PyTree:
        for leaf in jax.tree_util.tree_leaves(tree):
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != self.n:
                raise ValueError(f"Trainer.init: per_rank=True needs every leaf to have a leading "
                                 f"axis of size {self.n} (one copy per rank), got shape "
                                 f"{np.shape(leaf)}.")
        tree = jax.device_put(tree, self._sharding(P(self.axis_name)))

        def body(t):
            # Initial params cross devices here: rank 0's copy goes to every rank. A SUM of
            # rank 0's values and zeros is exact and typed replicated, so out_specs=P() holds.
            first = lax.axis_index(self.axis_name) == 0
            t = jax.tree_util.tree_map(lambda a: jnp.where(first, a[0], jnp.zeros_like(a[0])), t)
            return primitives.all_reduce(t, self.axis_name, "sum")

        f = jax.shard_map(body, mesh=self.mesh, in_specs=P(self.axis_name), out_specs=P())
        return jax.jit(f)(tree)

    def _init_sharded_opt(self, params: PyTree) -> PyTree:
        layout = self._layout

        def body(p):
            shard = layout.shard(layout.flatten(p), lax.axis_index(self.axis_name))
            opt = self.optimizer.init(shard)
            return jax.tree_util.tree_map(lambda a: a[None], opt)

        f = jax.shard_map(body, mesh=self.mesh, in_specs=P(), out_specs=P(self.axis_name))
        return jax.jit(f)(params)

    # ---------------------------------------------------------------------------------- step
    def step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on a GLOBAL batch (NumPy or jax arrays, a pytree).

        The batch's leading axis is split over the devices (and into ``accum_steps``
        micro-batches); its size must be a multiple of ``n * accum_steps``, else ValueError.

        Returns:
            The new state (the old one's buffers are donated when ``donate=True``) and the
            metrics (``loss`` and the loss_fn's aux), averaged over the global batch.
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"Trainer.step: state must be the TrainState that Trainer.init "
                            f"returned, got {type(state).__name__} instead.")
        batch = self.shard_batch(batch)
        if self._step_fn is None:
            self._step_fn = self._build_step(state)
        return self._step_fn(state, batch)

    def _build_step(self, state: TrainState):
        specs = self._state_specs(state)
        out_specs = specs
        if self.shard_optimizer:  # the body returns this rank's updated shard of the params
            out_specs = specs.replace(params=P(self.axis_name))
        # ring/tree/auto results are replicated in value but typed varying by shard_map, which
        # then cannot check out_specs=P(): those run without the check (and without the
        # gradient trap: jax.grad inserts no reduction there either). Equivalence is tested.
        mapped = jax.shard_map(self._step_body, mesh=self.mesh,
                               in_specs=(specs, P(self.axis_name)), out_specs=(out_specs, P()),
                               check_vma=self.grad_sync == "native")
        if not self.shard_optimizer:
            return jax.jit(mapped, donate_argnums=(0,) if self.donate else ())
        layout, axis = self._layout, self.axis_name
        # check_vma=False: the all-gathered params are replicated, which shard_map cannot infer.
        gather = jax.shard_map(
            lambda s: all_gather_params(s, layout, axis, algorithm=self.algorithm),
            mesh=self.mesh, in_specs=P(axis), out_specs=P(), check_vma=False)

        def zero1(state, batch):
            new, metrics = mapped(state, batch)
            return new.replace(params=gather(new.params)), metrics

        return jax.jit(zero1, donate_argnums=(0,) if self.donate else ())

    def _local_grads(self, params, model_state, batch, key):
        """Mean gradient of this rank's share of the batch, over ``accum_steps`` micro-batches."""
        names = axis_names(self.axis_name)
        # The fix for the gradient trap: varying params, so jax.grad does not psum by itself.
        params = to_varying(params, names)
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        k = self.accum_steps
        if k == 1:
            (loss, (aux, model_state)), grads = grad_fn(params, model_state, batch, key)
            return grads, loss, aux, model_state
        micro = jax.tree_util.tree_map(lambda a: a.reshape((k, a.shape[0] // k) + a.shape[1:]),
                                       batch)
        model_state = to_varying(model_state, names)  # one carry type through the scan

        def one(carry, xs):
            g_sum, loss_sum, aux_sum, ms = carry
            mb, i = xs
            (loss, (aux, ms)), g = grad_fn(params, ms, mb, jax.random.fold_in(key, i))
            ms = to_varying(ms, names)
            add = jax.tree_util.tree_map(jnp.add, (g_sum, loss_sum, aux_sum), (g, loss, aux))
            return (*add, ms), None

        shapes = jax.eval_shape(grad_fn, params, model_state,
                                jax.tree_util.tree_map(lambda a: a[0], micro), key)
        (_, (aux0, _)), g0 = shapes
        zeros = jax.tree_util.tree_map(
            lambda s: to_varying(jnp.zeros(s.shape, s.dtype), names), (g0, aux0))
        init = (zeros[0], to_varying(jnp.zeros((), jnp.float32), names), zeros[1], model_state)
        (g_sum, loss_sum, aux_sum, model_state), _ = lax.scan(one, init, (micro, jnp.arange(k)))
        scale = lambda t: jax.tree_util.tree_map(lambda a: a / k, t)  # noqa: E731
        return scale(g_sum), loss_sum / k, scale(aux_sum), model_state

    def _step_body(self, state: TrainState, batch: PyTree):
        axis, names = self.axis_name, axis_names(self.axis_name)
        rank = lax.axis_index(axis)
        key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), rank)
        grads, loss, aux, model_state = self._local_grads(state.params, state.model_state,
                                                          batch, key)
        metrics = _mean_metrics({"loss": loss, **aux}, axis, self.algorithm["all_reduce"])
        if is_varying(model_state, names):
            # Unsynchronised buffers (plain BatchNorm) differ per rank: average them.
            model_state = primitives.all_reduce(to_varying(model_state, names), axis, "avg",
                                                **self.algorithm["all_reduce"])
        if self.shard_optimizer:
            layout = self._layout
            g_shard = reduce_scatter_mean(layout.flatten(grads), layout, axis,
                                          grad_dtype=self.grad_dtype, algorithm=self.algorithm)
            p_shard = layout.shard(layout.flatten(state.params), rank)
            opt_state = jax.tree_util.tree_map(lambda a: a[0], state.opt_state)
            updates, opt_state = self.optimizer.update(g_shard, opt_state, p_shard)
            params = optax.apply_updates(p_shard, updates)
            opt_state = jax.tree_util.tree_map(lambda a: a[None], opt_state)
        else:
            grads = mean_gradients(grads, axis, bucket_bytes=self.bucket_bytes,
                                   grad_dtype=self.grad_dtype, algorithm=self.algorithm)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        new = TrainState(params, opt_state, model_state, state.step + 1, state.rng)
        return new, metrics

    # ------------------------------------------------------------------------------ evaluate
    def evaluate(self, state: TrainState, data: Any) -> dict[str, float]:
        """Average ``loss`` and the aux metrics over every example in ``data``.

        ``data`` is an iterable of global batches (or a :class:`~jaxcoll.dp.Batches`, whose
        first epoch is used). The loss_fn runs with ``rng=None`` (no dropout; adapters use
        BatchNorm's running statistics). Batches are weighted by their size; each must split
        evenly over the devices.
        """
        if self._eval_fn is None:
            specs = self._state_specs(state)

            def body(state, batch):
                loss, (aux, _) = self._loss(state.params, state.model_state, batch, None)
                return _mean_metrics({"loss": loss, **aux}, self.axis_name,
                                     self.algorithm["all_reduce"])

            self._eval_fn = jax.jit(jax.shard_map(body, mesh=self.mesh,
                                                  in_specs=(specs, P(self.axis_name)),
                                                  out_specs=P()))
        batches = data.epoch(0) if hasattr(data, "epoch") else data
        totals: dict[str, float] = {}
        count = 0
        for batch in batches:
            size = np.shape(jax.tree_util.tree_leaves(batch)[0])[0]
            out = jax.device_get(self._eval_fn(state, self.shard_batch(batch,
                                                                       "Trainer.evaluate")))
            for name, value in out.items():
                totals[name] = totals.get(name, 0.0) + float(value) * size
            count += size
        if not count:
            raise ValueError("Trainer.evaluate: data yielded no batch.")
        return {name: value / count for name, value in totals.items()}

    # ----------------------------------------------------------------------------------- fit
    def fit(
        self,
        state: TrainState,
        data: Any,
        *,
        steps: int | None = None,
        epochs: int | None = None,
        eval_data: Any = None,
        checkpoint_dir: str | None = None,
        every: int = 100,
        progress: bool = True,
        log_every: int = 10,
    ) -> tuple[TrainState, list[dict[str, float]]]:
        """Train until ``state.step`` reaches ``steps`` (or ``epochs`` epochs of ``data``).

        ``data`` is a :class:`~jaxcoll.dp.Batches` (batch s is ``data[s]``, so a resumed run
        sees exactly the batches it would have) or any iterable of global batches (a resumed
        run skips the first ``state.step`` of them). With ``checkpoint_dir``, the latest
        checkpoint there is restored first, and the state is saved every ``every`` steps and
        at the end (orbax-checkpoint): a run stopped at any point and started again with the
        same arguments ends bit-identical to one that was never stopped.

        Returns:
            The final state and a history: one dict per step taken in this call with the step,
            the metrics and ``examples_per_s``; with ``eval_data``, the last entry also has
            ``eval_<metric>`` for each metric of :meth:`evaluate`.
        """
        from tqdm.auto import tqdm

        from .checkpoint import Checkpointer

        total = total_steps(data, steps, epochs)
        ckpt = None
        if checkpoint_dir is not None:
            ckpt = Checkpointer(checkpoint_dir, every=every)
            state = ckpt.restore_latest(state)
        start = int(jax.device_get(state.step))
        source = batch_source(data, start)
        history: list[dict[str, Any]] = []
        bar = tqdm(total=total, initial=start, disable=not progress, unit="step",
                   dynamic_ncols=True)
        try:
            for s in range(start, total):
                batch = source(s)
                size = np.shape(jax.tree_util.tree_leaves(batch)[0])[0]
                t0 = time.perf_counter()
                state, metrics = self.step(state, batch)
                # Wait for the step: honest examples/s, and one program in flight at a time
                # (many queued collective programs on few CPU cores can stall XLA's rendezvous).
                metrics = jax.block_until_ready(metrics)
                history.append({"step": s + 1, "examples": size, "t0": t0, **metrics})
                if ckpt is not None and (s + 1) % every == 0:
                    ckpt.save(state)
                bar.update(1)
                if progress and ((s + 1) % log_every == 0 or s + 1 == total):
                    bar.set_postfix(loss=f"{float(metrics['loss']):.4f}")
            if ckpt is not None:
                ckpt.save(state)
        finally:  # a crash keeps only the periodic checkpoints, as a killed process would
            bar.close()
            if ckpt is not None:
                ckpt.close()
        history = finish_history(history)
        if eval_data is not None:
            results = self.evaluate(state, eval_data)
            if history:
                history[-1].update({f"eval_{k}": v for k, v in results.items()})
            else:
                history.append({f"eval_{k}": v for k, v in results.items()})
        return state, history


def _stateless(loss_fn: LossFn):
    def loss(params, model_state, batch, rng):
        value, aux = loss_fn(params, batch, rng)
        return value, (dict(aux or {}), model_state)

    return loss


def _mean_metrics(metrics: dict[str, jax.Array], axis: AxisName,
                  kwargs: dict[str, str]) -> dict[str, jax.Array]:
    """Average scalar metrics over ranks in one collective (each rank holds equal shares)."""
    names = sorted(metrics)
    if not names:
        return {}
    vec = jnp.stack([jnp.asarray(metrics[k], jnp.float32).reshape(()) for k in names])
    vec = primitives.all_reduce(to_varying(vec, axis_names(axis)), axis, "avg", **kwargs)
    return {k: vec[i] for i, k in enumerate(names)}
