"""What the pipeline's lowerings share: splitting into micro-batches, the checks of a stage,
the axes values vary over, and GPipe's forward schedule."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import primitives
from .._core.typing import PyTree
from .._core.vma import cast_varying, varying_axes
from ._lowering import Staged, add_aux, aux_zeros, call_stage, side_at, split_output
from .schedules import Schedule


def _names(*trees: Any) -> tuple:
    """Every mesh axis any leaf of ``trees`` varies over (shard_map's types), sorted (a
    :class:`MicroBatches` leaf: its stack's)."""
    out: set = set()
    for leaf in jax.tree_util.tree_leaves(trees):
        leaf = leaf.stack if isinstance(leaf, MicroBatches) else leaf
        out |= set(varying_axes(leaf) or ())
    return tuple(sorted(out, key=str))


def _microbatches(api: str, x: jax.Array, schedule: Schedule) -> jax.Array:
    """``x`` as ``schedule``'s M micro-batches, in place: ``(B // M, M, ...)`` (a reshape, no
    copy), micro-batch m being rows m::M (:func:`_at`), as a Trainer's ``accum_steps`` cuts
    its micro-batches: a replica's rows m::M are its share of the global rows m::M."""
    m = schedule.microbatches
    if x.ndim == 0 or x.shape[0] % m:
        raise ValueError(
            f"{api}: the batch has {x.shape[0] if x.ndim else 0} examples, which "
            f"do not split into the {m} of {schedule!r} equal micro-batches. Pick a "
            f"divisor of the per-replica batch size."
        )
    return x.reshape((x.shape[0] // m, m) + x.shape[1:])


def _at(stack: jax.Array, k: Any) -> jax.Array:
    """Micro-batch ``k`` of ``stack`` (``(B // M, M, ...)``, :func:`_microbatches`): its rows
    k::M, read in place."""
    return lax.dynamic_index_in_dim(stack, k, axis=1, keepdims=False)


def _targets_at(ys: PyTree, k: Any) -> PyTree:
    """Micro-batch ``k`` of every leaf of ``ys`` (each ``(B // M, M, ...)``)."""
    return jax.tree_util.tree_map(lambda t: _at(t, k), ys)


def _put(stack: jax.Array, k: Any, value: jax.Array) -> jax.Array:
    """``stack`` (``(B // M, M, ...)``) with micro-batch ``k`` set to ``value``, in place."""
    return lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), k, axis=1)


class MicroBatches:
    """M micro-batches read in place from ``stack``: micro-batch k is ``stack``'s index k
    on ``axis`` (1 for :func:`_microbatches`' ``(B // M, M, ...)``, 0 for a schedule's own
    ``(M, mb, ...)`` buffers). Indexed and shaped as ``(M, mb, ...)`` (``xs[k]``,
    ``xs.shape[0]`` is M), so a schedule reads micro-batch k without a transposed copy; a
    leaf of a pytree (side inputs: one per leaf)."""

    def __init__(self, stack: jax.Array, axis: int = 1) -> None:
        self.stack, self.axis = stack, axis

    @property
    def shape(self) -> tuple:
        """``(M, mb, ...)``."""
        shape = self.stack.shape
        return (shape[self.axis],) + shape[: self.axis] + shape[self.axis + 1 :]

    @property
    def dtype(self) -> Any:
        return self.stack.dtype

    @property
    def ndim(self) -> int:
        return self.stack.ndim

    def __getitem__(self, k: Any) -> jax.Array:
        """Micro-batch ``k`` (an int or a traced index)."""
        return lax.dynamic_index_in_dim(self.stack, k, axis=self.axis, keepdims=False)


def in_place(tree: PyTree, axis: int = 1) -> PyTree:
    """Every leaf of ``tree`` (None stays None) as :class:`MicroBatches` on ``axis``."""
    if tree is None:
        return None
    return jax.tree_util.tree_map(lambda t: MicroBatches(jnp.asarray(t), axis), tree)


def _rows_checked(api: str, name: str, examples: int, tree: PyTree, why: str) -> None:
    """Raise unless every leaf of ``tree`` (the argument ``name``) has one row per example of
    ``x``; ``why`` ends the message (what the rows are paired with, and the fix)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = jnp.shape(leaf)
        if not shape or shape[0] != examples:
            got = f"{shape[0]} examples" if shape else "no leading axis (a scalar)"
            raise ValueError(
                f"{api}: {name}{jax.tree_util.keystr(path)} has {got} but x has {examples}; {why}"
            )


def _check_targets(api: str, examples: int, y: PyTree) -> None:
    """Every leaf of ``y`` has one row per example of ``x``: micro-batch i of ``x`` is scored
    against rows of ``y`` cut the same way, so other counts would pair the wrong rows."""
    _rows_checked(
        api,
        "y",
        examples,
        y,
        f"the last stage scores micro-batch i of x against the same rows of y, so y needs "
        f"one target per example of x. Pass the targets of exactly this replica's rows of x "
        f"(a leading axis of {examples}).",
    )


def _check_side(api: str, examples: int, side: PyTree) -> None:
    """Every leaf of ``side`` has one row per example of ``x``: each stage is handed
    micro-batch i of ``side`` with micro-batch i of ``x``."""
    _rows_checked(
        api,
        "side",
        examples,
        side,
        f"every stage is handed micro-batch i of side with micro-batch i of x, so side needs "
        f"one row per example of x. Pass this replica's rows (a leading axis of {examples}: "
        f"positions, segment ids, masks per token); a value the same for every example "
        f"belongs in stage_fn itself.",
    )


def _check_stage(
    api: str,
    stage_fn: Callable,
    params: PyTree,
    xs: MicroBatches,
    sides: PyTree = None,
    has_aux: bool = False,
) -> None:
    # Typed as the schedule calls it: varying over every axis the params or inputs vary over.
    def probe_fn(params: PyTree, h: jax.Array, side: PyTree) -> Any:
        return call_stage(stage_fn, params, h, side)

    h0 = cast_varying(xs[0], _names(params, xs))
    out = jax.eval_shape(probe_fn, params, h0, side_at(sides, 0))
    if has_aux:
        _check_aux(api, out)
    probe = split_output(out, has_aux)[0]
    if (probe.shape, probe.dtype) != (xs.shape[1:], xs.dtype):
        raise ValueError(
            f"{api}: stage_fn maps a micro-batch of shape {xs.shape[1:]} "
            f"{xs.dtype} to {probe.shape} {probe.dtype}; every stage must keep the "
            f"activation's shape and dtype (one SPMD program runs every stage). "
            f"Pad or project the activations to one width."
        )


def _carried(
    stage_fn: Callable,
    params: PyTree,
    xs: MicroBatches,
    s: jax.Array,
    sides: PyTree = None,
    has_aux: bool = False,
) -> tuple:
    """The axes the forward's activations vary over: the inputs' and the stage's, and those
    ``stage_fn``'s output varies over given such an input (a fixed point). A stage whose
    output is the same across a tensor axis (a Megatron block ends with its all-reduce)
    keeps it invariant there, so the model's output is too."""
    names = set(_names(xs, s))

    def probe_fn(params: PyTree, h: jax.Array, side: PyTree) -> jax.Array:
        return call_stage(stage_fn, params, h, side)

    while True:
        h0 = cast_varying(xs[0], tuple(sorted(names, key=str)))
        probe = split_output(jax.eval_shape(probe_fn, params, h0, side_at(sides, 0)), has_aux)[0]
        grown = names | set(varying_axes(probe) or ())
        if grown == names:
            return tuple(sorted(names, key=str))
        names = grown


def _no_head(*args: Any) -> Any:
    raise NotImplementedError("the forward schedule runs no head")


def _check_aux(api: str, out: Any) -> None:
    """A stage that has aux returns ``(h, (loss_term, aux))``, ``loss_term`` a float scalar."""
    ok = isinstance(out, tuple) and len(out) == 2
    ok = ok and isinstance(out[1], tuple) and len(out[1]) == 2
    term: Any = out[1][0] if ok else None
    dtype: Any = getattr(term, "dtype", None)
    if getattr(term, "shape", None) != () or not jnp.issubdtype(dtype, jnp.floating):
        got = jax.tree_util.tree_map(lambda v: f"{v.dtype}{list(v.shape)}", out)
        raise ValueError(
            f"{api}: with has_aux=True, stage_fn must return (h, (loss_term, aux)): the new "
            f"activation, a float scalar added to the micro-batch's loss (e.g. a weighted "
            f"load-balancing loss) and a pytree of metrics; got {got}. Return "
            f"(h, (jnp.zeros(()), aux)) for a stage without a loss term."
        )


def _forward(
    api: str,
    stage_fn: Callable,
    params: PyTree,
    xs: jax.Array | MicroBatches,
    stage_axis: Hashable,
    *,
    sides: PyTree = None,
) -> tuple[jax.Array, jax.Array]:
    """The forward schedule (:func:`_forward_aux` without aux): each stage's saved inputs
    ``(M, mb, ...)`` and, on the last stage, the outputs. ``xs`` (and every leaf of
    ``sides``): :class:`MicroBatches`, or an array ``(M, mb, ...)``, micro-batch m at m."""
    if not isinstance(xs, MicroBatches):
        xs, sides = MicroBatches(xs, axis=0), in_place(sides, axis=0)
    saved, outs, _ = _forward_aux(api, stage_fn, params, xs, stage_axis, sides=sides)
    return saved, outs


def _forward_aux(
    api: str,
    stage_fn: Callable,
    params: PyTree,
    xs: MicroBatches,
    stage_axis: Hashable,
    *,
    sides: PyTree = None,
    has_aux: bool = False,
) -> tuple[jax.Array, jax.Array, tuple]:
    """The forward schedule: at step t stage s runs micro-batch t - s (with its side inputs,
    where ``sides`` is not None; ``xs`` and every leaf of ``sides`` :class:`MicroBatches`,
    read in place). Returns each stage's saved inputs ``(M, mb, ...)``, on
    the last stage the outputs, and this stage's ``(loss terms, aux)`` (:func:`aux_zeros`;
    with ``has_aux``, ``stage_fn`` returns ``(h, (loss_term, aux))``)."""
    n_stages = primitives.world_size(stage_axis)
    m = xs.shape[0]
    s = primitives.rank(stage_axis)
    _check_stage(api, stage_fn, params, xs, sides, has_aux)
    names = _carried(stage_fn, params, xs, s, sides, has_aux)
    zero = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), names)
    buffers = cast_varying(jnp.zeros(xs.shape, xs.dtype), names)  # (M, mb, ...): their own
    forward = [(i, i + 1) for i in range(n_stages - 1)]
    # The stage alone (no head: the forward schedule runs none).
    # Staged reads xs as (M, mb, ...) by index and shape: MicroBatches reads it in place.
    inputs: Any = xs
    staged = Staged(stage_fn, _no_head, params, inputs, None, stage_axis, (), sides, has_aux)
    extra0 = aux_zeros(staged, names)

    def step(carry, t):
        received, saved, outs, extra = carry
        mb = t - s
        active = (mb >= 0) & (mb < m)
        k = jnp.clip(mb, 0, m - 1)
        inp = jnp.where(s == 0, xs[jnp.clip(t, 0, m - 1)], received)
        out, term, aux = staged.forward(params, inp, k)
        if term is not None:  # an idle step adds nothing
            term = jnp.where(active, term, jnp.zeros_like(term))
            aux = jax.tree_util.tree_map(
                lambda a, b: jnp.where(active, a, b[k].astype(a.dtype)), aux, extra[1]
            )
        extra = add_aux(extra, term, aux, k)
        saved = saved.at[k].set(jnp.where(active, inp, saved[k]))
        outs = outs.at[k].set(jnp.where(active & (s == n_stages - 1), out, outs[k]))
        # -> the activation crosses to the next stage (send/recv: one ppermute)
        return (primitives.sendrecv(out, stage_axis, forward), saved, outs, extra), None

    carry = (zero, buffers, buffers, extra0)
    (_, saved, outs, extra), _ = lax.scan(step, carry, jnp.arange(m + n_stages - 1))
    return saved, outs, extra
