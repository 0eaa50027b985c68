"""The step builder: one jitted program per Trainer, from a loss, a strategy and a bound
layout.

Pure functions: nothing here keeps state. :func:`build_step` returns the jitted step,
:func:`build_eval` the jitted evaluation; both run their per-rank part in ``jax.shard_map``
with checking on (``check_vma=True``), whatever the algorithm, with the layout's names in
force while it is traced (model code's roles and logical axes resolve to its mesh axes:
:mod:`jaxcoll._core.roles`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ... import primitives
from ..._core.typing import AxisName, PyTree
from ..._core.vma import axis_names, to_varying, varying_axes
from ..checks import LossOutputError, float_params
from ..extra import Extra
from ..layout import BoundLayout
from ..state import TrainState
from ..sync.base import Strategy, specs_like
from .honoured import check_honoured, manual_axes, only, tensor_pinned, tracing

# loss(params, model_state, batch, rng, step) -> (loss, (aux, new_model_state)), its output
# already checked (the Trainer wraps the user's loss_fn or dp.Model into this form).
StateLoss = Callable[..., tuple[jax.Array, tuple[dict[str, jax.Array], PyTree]]]


def local_grads(
    loss: StateLoss,
    params: PyTree,
    model_state: PyTree,
    batch: PyTree,
    key: jax.Array,
    step: jax.Array,
    axis_name: AxisName,
    accum_steps: int,
    strategy: Strategy | None = None,
    like: PyTree = None,
    model_axes: tuple = (),
    honoured: Callable[[Callable[[], object]], None] | None = None,
):
    """This rank's mean gradient over ``accum_steps`` micro-batches of its share of the batch
    (its rows of the global micro-batches: :func:`micro_batches`).

    ``params`` are as the train state holds them; ``strategy.loss_of_held`` gives the loss
    the whole params (the same, or gathered for FSDP). Returns ``(grads, loss, aux,
    model_state)``, all local (varying over the data axis).
    """
    names = axis_names(axis_name)
    # The fix for the gradient trap: varying params, so jax.grad does not psum by itself.
    params = to_varying(params, names)
    if strategy is None:
        of_params = lambda p, ms, b, r: loss(p, ms, b, r, step)  # noqa: E731
    else:
        of_params = strategy.loss_of_held(lambda p, ms, b, r: loss(p, ms, b, r, step), like)
    grad_fn = jax.value_and_grad(_checked(of_params, model_axes, honoured), has_aux=True)
    k = accum_steps
    if k == 1:
        (value, (aux, model_state)), grads = grad_fn(params, model_state, batch, key)
        return grads, value, aux, model_state
    micro = jax.tree_util.tree_map(lambda a: micro_batches(a, k), batch)
    model_state = to_varying(model_state, names)  # one carry type through the scan

    def one(carry, xs):
        g_sum, loss_sum, aux_sum, ms = carry
        mb, i = xs
        (value, (aux, ms)), g = grad_fn(params, ms, mb, jax.random.fold_in(key, i))
        ms = to_varying(ms, names)
        add = jax.tree_util.tree_map(jnp.add, (g_sum, loss_sum, aux_sum), (g, value, aux))
        return (*add, ms), None

    shapes = jax.eval_shape(
        grad_fn, params, model_state, jax.tree_util.tree_map(lambda a: a[0], micro), key
    )
    (_, (aux0, _)), g0 = shapes
    # The sums start typed as the gradients are: varying over the data axes, and over a
    # model axis where the gradient is a slice (a tensor-parallel kernel's).
    zeros = jax.tree_util.tree_map(
        lambda s: to_varying(
            jnp.zeros(s.shape, s.dtype), names + tuple(sorted(varying_axes(s) or (), key=str))
        ),
        (g0, aux0),
    )
    init = (zeros[0], to_varying(jnp.zeros((), jnp.float32), names), zeros[1], model_state)
    (g_sum, loss_sum, aux_sum, model_state), _ = lax.scan(one, init, (micro, jnp.arange(k)))
    scale = lambda t: jax.tree_util.tree_map(lambda a: a / k, t)  # noqa: E731
    return scale(g_sum), loss_sum / k, scale(aux_sum), model_state


def micro_batches(rows: jax.Array, k: int) -> jax.Array:
    """This rank's ``rows`` as ``k`` micro-batches, stacked: micro-batch ``j`` is its rows
    ``j, j + k, j + 2k, ...``.

    Each rank holds a contiguous block of the global batch whose start is a multiple of its
    size ``m`` (and ``m`` a multiple of ``k``), so its row ``i`` is global row
    ``start + i`` and ``i = j (mod k)`` exactly when the global row is. Micro-batch ``j`` is
    therefore the same global rows ``j::k`` on every layout (one device, any mesh, any number
    of processes, a host or an already placed batch), each rank holding its share of them, in
    global order: what a micro-batch's statistics (SyncBatchNorm's, a mixture of experts'
    load-balancing loss) are taken over does not depend on the layout, with no data moved.
    """
    return jnp.swapaxes(rows.reshape((rows.shape[0] // k, k) + rows.shape[1:]), 0, 1)


def _checked(
    fn: Callable[..., tuple],
    model_axes: tuple,
    honoured: Callable[[Callable[[], object]], None] | None = None,
) -> Callable[..., tuple]:
    """``fn`` (a per-rank loss with its aux) with ``honoured()`` (the layout's roles used:
    :func:`~jaxcoll.dp.step.honoured.check_honoured`) and :func:`invariant_over` checked on
    its output; ``fn`` itself without either."""
    if not model_axes and honoured is None:
        return fn

    def checked(*args):
        out = fn(*args)
        if honoured is not None:
            honoured(lambda: jax.make_jaxpr(fn)(*args))
        invariant_over(model_axes, out[0], out[1][0])
        return out

    return checked


def invariant_over(model_axes: tuple, loss: jax.Array, metrics: dict[str, jax.Array]) -> None:
    """Raise (as the op that traced the loss) if the loss or a metric varies over one of the
    layout's axes: each device of a tensor or pipeline group must hold the same value, else
    ``jax.grad`` would sum the group's losses (a gradient ``k`` times too large) and the
    metrics could not be averaged once."""
    named = {"the loss": loss, **{f"metric {k!r}": v for k, v in metrics.items()}}
    for name, value in named.items():
        axes = sorted(set(varying_axes(value) or ()) & set(model_axes))
        if axes:
            raise LossOutputError(
                ValueError,
                f"{name} varies over the model axis {axes[0]!r} (the layout's tensor or "
                f"pipeline axis): each device there must compute the same value. End the "
                f"tensor-parallel part of the model with a reduction over {axes[0]!r} (a "
                f"row-parallel layer, jaxcoll.nn's layers do) and a pipeline with "
                f"parallel.pipeline_loss, whose value is the same on every stage.",
            )


def mean_metrics(
    metrics: dict[str, jax.Array], axis_name: AxisName, algorithm: str
) -> dict[str, jax.Array]:
    """Average scalar metrics over ranks in one collective (each rank holds equal shares)."""
    names = sorted(metrics)
    if not names:
        return {}
    vec = jnp.stack([jnp.asarray(metrics[k], jnp.float32).reshape(()) for k in names])
    vec = primitives.all_reduce(
        to_varying(vec, axis_names(axis_name)), axis_name, "avg", algorithm=algorithm
    )
    return {k: vec[i] for i, k in enumerate(names)}


def sync_model_state(model_state: PyTree, axis_name: AxisName, algorithm: str) -> PyTree:
    """The model state (BatchNorm statistics) made equal on every rank, every step.

    Floating leaves are averaged over the data axis (flax's ImageNet example ``pmean``s its
    ``batch_stats`` the same way): a plain BatchNorm's per-rank running statistics become
    their mean, a SyncBatchNorm's (equal already) stay equal. Other leaves (integer counters)
    take rank 0's value, as DDP broadcasts its buffers. Unconditional: never decided from a
    value's type.
    """
    names = axis_names(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(model_state)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
    out = list(leaves)
    if floats:
        # Model state crosses devices here: one all-reduce (per dtype) for every float leaf.
        mean = primitives.all_reduce(
            to_varying([leaves[i] for i in floats], names), axis_name, "avg", algorithm=algorithm
        )
        for i, x in zip(floats, mean, strict=True):
            out[i] = x
    for i, x in enumerate(leaves):
        if i not in floats:
            out[i] = primitives.broadcast(to_varying(x, names), axis_name, 0, algorithm=algorithm)
    return jax.tree_util.tree_unflatten(treedef, out)


def state_shardings(strategy: Strategy, state: TrainState) -> TrainState:
    """Where every leaf of the TrainState lives: as the strategy places the params, the
    optimizer state and the extra state; the model state, step and rng replicated; the hook
    state split per rank: ``state`` with a ``NamedSharding`` in place of every leaf."""
    replicated = NamedSharding(strategy.mesh, P())
    rep = lambda t: jax.tree_util.tree_map(lambda _: replicated, t)  # noqa: E731
    named = strategy.named
    per_rank = NamedSharding(strategy.mesh, P(strategy.axis_name))
    return state.replace(
        params=named(strategy.state_param_specs(state.params)),
        opt_state=named(strategy.opt_specs(state.opt_state, state.params)),
        model_state=rep(state.model_state),
        step=replicated,
        rng=replicated,
        extra=named(strategy.extra_specs(state.extra, state.params)),
        comm_state=jax.tree_util.tree_map(lambda _: per_rank, state.comm_state),
    )


def abstract(tree: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` of every leaf (shapes only: no buffer is kept alive)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _own(tree: PyTree) -> PyTree:
    """Per rank: this rank's state from its (1, ...) slice of the per-rank stack."""
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def _stack(tree: PyTree, names: tuple) -> PyTree:
    """Per rank: the state as this rank's (1, ...) slice of the per-rank stack (varying)."""
    return jax.tree_util.tree_map(lambda x: to_varying(x, names)[None], tree)


def all_finite(*trees: PyTree) -> jax.Array:
    """True when every element of every floating leaf is finite (a scalar bool)."""
    leaves = [
        x
        for t in trees
        for x in jax.tree_util.tree_leaves(t)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    ok = jnp.asarray(True)
    for x in leaves:
        ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def build_step(
    loss: StateLoss,
    strategy: Strategy,
    state: TrainState,
    layout: BoundLayout,
    *,
    accum_steps: int,
    donate: bool,
    extra: Extra | None = None,
    skip_nonfinite: bool = False,
):
    """The jitted step ``(state, batch) -> (state, metrics)`` for states shaped like ``state``.

    Per rank (``shard_map``, params as the state holds them: ``strategy.held``, the state's
    own but for a semi-synchronous strategy's replicas; the batch split over the data
    axes as ``layout.split`` says): the local gradients, the metrics and the model state
    averaged over ranks, the gradients synchronised by ``strategy.reduce``
    (:func:`per_rank_step`). Then, in the global view of the same program:
    ``strategy.update``, then ``extra.update`` (:class:`~jaxcoll.dp.Extra`). With
    ``skip_nonfinite``, a step whose loss or synchronised gradients hold an inf or NaN keeps
    the old params, optimizer state, model state and extra (the step count still advances:
    it is the data position) and reports ``skipped=1.0`` (:func:`keep_if_finite`). The
    state's buffers are donated when ``donate``.
    """
    modes: dict = {}  # the shard_map's manual axes, decided when the step is first traced

    def step(state: TrainState, batch: PyTree):
        # Checked when traced (each new state signature): an integer param would otherwise
        # fail inside jax.grad, unnamed.
        float_params("Trainer.step", state.params, strategy.grad_route)
        held = strategy.held(state.params, state.opt_state)  # the params the loss sees
        args = (held, state.model_state, state.comm_state, batch, state.step, state.rng)
        if "manual" not in modes:
            modes["manual"] = manual_axes(
                layout, lambda m: per_rank_step(loss, strategy, state, layout, accum_steps, m), args
            )
        mapped = per_rank_step(loss, strategy, state, layout, accum_steps, modes["manual"])
        grads, model_state, comm_state, metrics = mapped(*args)
        params, opt_state = strategy.update(grads, state.opt_state, state.params)
        new = TrainState(
            params, opt_state, model_state, state.step + 1, state.rng, state.extra, comm_state
        )
        if extra is not None:
            new = new.replace(extra=extra.update(state.extra, new, metrics))
        if skip_nonfinite:
            new, metrics = keep_if_finite(state, new, grads, metrics)
        return new, metrics

    out = (state_shardings(strategy, state), NamedSharding(strategy.mesh, P()))
    return jax.jit(step, donate_argnums=(0,) if donate else (), out_shardings=out)


def per_rank_step(
    loss: StateLoss,
    strategy: Strategy,
    state: TrainState,
    layout: BoundLayout,
    accum_steps: int,
    manual: frozenset | None = None,
) -> Callable:
    """The step's per-rank half, a ``jax.shard_map``: ``(params, model_state, comm_state,
    batch, step, rng) -> (grads, model_state, comm_state, metrics)``, the gradients
    synchronised and laid out as ``strategy.grad_specs`` says, traced with the layout's names
    in force. ``manual``: the mesh axes it is manual over (default: all; without the tensor
    axis where XLA partitions the model over it: :func:`manual_axes`)."""
    manual = frozenset(strategy.mesh.axis_names) if manual is None else manual
    axis, algorithm = strategy.axis_name, strategy.algorithm
    names = axis_names(axis)
    like = abstract(state.params)
    split = layout.split
    loss = tensor_pinned(loss, strategy, like, layout, manual)

    def per_rank(params, model_state, comm_state, batch, step, rng):
        with tracing(layout) as used:
            params = strategy.own_held(params)
            batch = split.part(batch)
            rank = lax.axis_index(axis)
            key = jax.random.fold_in(jax.random.fold_in(rng, step), rank)
            grads, value, aux, model_state = local_grads(
                loss,
                params,
                model_state,
                batch,
                key,
                step,
                axis,
                accum_steps,
                strategy,
                like,
                tuple(a for a in layout.axes if a in manual),
                lambda traced: check_honoured("Trainer.step", layout, used, traced),
            )
            metrics = mean_metrics({"loss": value, **aux}, axis, algorithm)
            model_state = sync_model_state(model_state, axis, algorithm)
            grads, comm_state = strategy.reduce(grads, _own(comm_state), step, like)
        return grads, model_state, _stack(comm_state, names), metrics

    per_rank_spec = specs_like(state.comm_state, P(axis))
    return jax.shard_map(
        per_rank,
        mesh=strategy.mesh,
        in_specs=(
            only(strategy.held_specs(state.params), manual),
            P(),
            per_rank_spec,
            split.spec,
            P(),
            P(),
        ),
        out_specs=(
            only(strategy.grad_specs(state.params), manual),
            specs_like(state.model_state, P()),
            per_rank_spec,
            P(),
        ),
        axis_names=set(manual),
    )


def keep_if_finite(
    old: TrainState, new: TrainState, grads: PyTree, metrics: dict[str, jax.Array]
) -> tuple[TrainState, dict[str, jax.Array]]:
    """``new``, or ``old`` (but its step count) where the loss or the synchronised gradients
    hold an inf or NaN; the metrics with ``skipped`` (1.0 where kept old, else 0.0)."""
    ok = all_finite(grads, metrics["loss"])
    keep = lambda a, b: jax.tree_util.tree_map(  # noqa: E731
        lambda x, y: jnp.where(ok, x, y), a, b
    )
    new = new.replace(
        params=keep(new.params, old.params),
        opt_state=keep(new.opt_state, old.opt_state),
        model_state=keep(new.model_state, old.model_state),
        extra=keep(new.extra, old.extra),
        comm_state=keep(new.comm_state, old.comm_state),
    )
    return new, {**metrics, "skipped": 1.0 - ok.astype(jnp.float32)}


def build_eval(loss: StateLoss, strategy: Strategy, params: PyTree, layout: BoundLayout):
    """The jitted evaluation ``(params, model_state, step, batch) -> metrics`` (global means)
    for params shaped and placed like ``params``.

    Every rank runs the loss with ``rng=None`` on its share of the batch (with the whole
    params: gathered for FSDP), the layout's names in force; the metrics are averaged over
    ranks (each holds as many examples, so that is the batch mean).
    """
    axis = strategy.axis_name
    like = abstract(params)
    split = layout.split

    def mapped(manual: frozenset) -> Callable:
        pinned = tensor_pinned(loss, strategy, like, layout, manual)

        def per_rank(params, model_state, step, batch):
            with tracing(layout) as used:
                batch = split.part(batch)
                of_held = strategy.loss_of_held(lambda p, ms, b: pinned(p, ms, b, None, step), like)
                held = to_varying(params, axis_names(axis))
                value, (aux, _) = of_held(held, model_state, batch)
                check_honoured(
                    "Trainer.evaluate",
                    layout,
                    used,
                    lambda: jax.make_jaxpr(of_held)(held, model_state, batch),
                )
                invariant_over(tuple(a for a in layout.axes if a in manual), value, aux)
                return mean_metrics({"loss": value, **aux}, axis, strategy.algorithm)

        return jax.shard_map(
            per_rank,
            mesh=strategy.mesh,
            in_specs=(only(strategy.state_param_specs(params), manual), P(), P(), split.spec),
            out_specs=P(),
            axis_names=set(manual),
        )

    modes: dict = {}

    def evaluate(params, model_state, step, batch):
        args = (params, model_state, step, batch)
        if "manual" not in modes:
            modes["manual"] = manual_axes(layout, mapped, args)
        return mapped(modes["manual"])(*args)

    return jax.jit(evaluate)
