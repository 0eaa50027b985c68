"""What every pipeline schedule's lowering takes: the staged model and its data on one stage."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .._core.typing import PyTree
from .._core.vma import cast_varying, varying_axes


@dataclass(frozen=True)
class Staged:
    """A stage's part of a pipelined model, as the lowerings (GPipe, 1F1B, interleaved,
    ZB-H1) run it. Each returns ``(loss, grads, d_head, d_xs)``: the last stage's mean loss (0
    or garbage elsewhere), this stage's gradient summed over micro-batches of the mean loss,
    the head's gradient (the last stage's, zero elsewhere) and the inputs' (stage 0's); GPipe,
    1F1B and ZB-H1 then ``(terms, auxs)`` too (:func:`aux_zeros`: with :attr:`has_aux`, this
    stage's loss terms summed over micro-batches and its aux per micro-batch)."""

    stage_fn: Callable
    """``(stage params, h) -> h``, or ``(stage params, h, side) -> h`` with side inputs (call
    it by :meth:`stage`)."""
    loss_fn: Callable
    """``(head, out, y) -> mean loss`` of one micro-batch (run on the last stage)."""
    own: PyTree
    """This stage's params (leading axis v for the interleaved schedule)."""
    xs: Any
    """The inputs, read as ``(M, micro-batch, ...)`` (by stage 0): ``xs[k]`` is micro-batch
    ``k``, the replica's rows ``k::M`` read in place (``_stages.MicroBatches``)."""
    ys: PyTree
    """The targets, every leaf the replica's rows as ``(rows / M, M, ...)`` (micro-batch ``k``
    at ``[:, k]``, read by the last stage)."""
    stage_axis: Hashable
    head: PyTree = ()
    """The head's params (``()``: none)."""
    sides: PyTree = None
    """The side inputs, every leaf read as ``xs`` is (by every stage: each holds the
    replica's whole batch), or None: ``stage_fn`` takes none."""
    has_aux: bool = False
    """``stage_fn`` returns ``(h, (loss_term, aux))``: a scalar added to the micro-batch's
    loss (differentiated) and a pytree the schedule keeps per micro-batch (not differentiated);
    call it by :meth:`forward`, differentiate it by :meth:`pullback`."""

    def parts(self) -> tuple:
        """``(stage_fn, loss_fn, own, xs, ys, stage_axis, head)``, for a lowering's locals."""
        return self.stage_fn, self.loss_fn, self.own, self.xs, self.ys, self.stage_axis, self.head

    def stage(self, params: PyTree, h: jax.Array, k: Any) -> jax.Array:
        """The stage on micro-batch ``k``: ``stage_fn(params, h)``, or with side inputs
        ``stage_fn(params, h, side_k)``."""
        return call_stage(self.stage_fn, params, h, side_at(self.sides, k))

    def at(self, k: Any) -> Callable[[PyTree, jax.Array], jax.Array]:
        """``(params, h) -> h``: the stage on micro-batch ``k`` (what ``jax.vjp`` takes)."""
        return lambda params, h: self.stage(params, h, k)

    def forward(self, params: PyTree, h: jax.Array, k: Any) -> tuple:
        """``(h, loss_term, aux)`` of the stage on micro-batch ``k``; ``(h, None, None)``
        without :attr:`has_aux`."""
        return split_output(self.stage(params, h, k), self.has_aux)

    def pullback(self, params: PyTree, h: jax.Array, k: Any, axes: tuple) -> Callable:
        """``ct -> (d_params, d_h)``: the vjp of the stage on micro-batch ``k`` given the
        cotangent ``ct`` of its output; with :attr:`has_aux`, its loss term's cotangent is
        ``1 / M`` (the loss is the mean over micro-batches), the term typed varying over
        ``axes`` first (the loss's axes: its transpose sums the cotangent over those it
        was invariant over, as ``jax.grad`` does for a term shared by the replicas)."""
        if not self.has_aux:
            return jax.vjp(self.at(k), params, h)[1]

        def stage(params: PyTree, h: jax.Array) -> tuple:
            out, term, _ = self.forward(params, h, k)
            return out, cast_varying(term.astype(jnp.float32), axes)

        _, vjp = jax.vjp(stage, params, h)
        scale = cast_varying(jnp.full((), 1.0 / self.xs.shape[0], jnp.float32), axes)
        return lambda ct: vjp((ct, scale))


def split_output(out: Any, has_aux: bool) -> tuple:
    """A stage's output as ``(h, loss_term, aux)`` (``(out, None, None)`` without aux)."""
    if not has_aux:
        return out, None, None
    h, (term, aux) = out
    return h, term, aux


def aux_zeros(p: Staged, act: tuple) -> tuple:
    """``(terms, auxs)``, zero: the sum of this stage's loss terms (a float32 scalar) and its
    aux per micro-batch (every leaf ``(M, ...)``), typed varying over ``act`` (the
    activations' axes) and over those the stage's own vary over; ``auxs`` is ``()`` without
    :attr:`Staged.has_aux`."""
    if not p.has_aux:
        return cast_varying(jnp.zeros((), jnp.float32), act), ()
    h0 = cast_varying(p.xs[0], act)
    _, term, aux = jax.eval_shape(lambda params, h: p.forward(params, h, 0), p.own, h0)
    m = p.xs.shape[0]

    def typed(shape: tuple, dtype: Any, leaf: Any) -> jax.Array:
        names = tuple(sorted(set(act) | set(varying_axes(leaf) or ()), key=str))
        return cast_varying(jnp.zeros(shape, dtype), names)

    terms = typed((), jnp.float32, term)
    return terms, jax.tree_util.tree_map(lambda v: typed((m, *v.shape), v.dtype, v), aux)


def add_aux(carry: tuple, term: Any, aux: PyTree, k: Any) -> tuple:
    """``(terms, auxs)`` with micro-batch ``k``'s loss term added and its aux written at
    ``k`` (``carry`` as it is without aux: ``term`` None)."""
    terms, auxs = carry
    if term is None:
        return carry
    auxs = jax.tree_util.tree_map(lambda b, a: b.at[k].set(a.astype(b.dtype)), auxs, aux)
    return terms + term.astype(jnp.float32), auxs


def side_at(sides: PyTree, k: Any) -> PyTree:
    """Micro-batch ``k`` of the side inputs ``sides`` (leaves read as ``(M, micro-batch,
    ...)``), or None where there are none."""
    return None if sides is None else jax.tree_util.tree_map(lambda v: v[k], sides)


def call_stage(stage_fn: Callable, params: PyTree, h: jax.Array, side: PyTree) -> jax.Array:
    """``stage_fn(params, h)``, or ``stage_fn(params, h, side)`` where ``side`` is not None."""
    return stage_fn(params, h) if side is None else stage_fn(params, h, side)


def axes_of(x: Any) -> tuple:
    """The mesh axes ``x`` varies over (shard_map's type), sorted."""
    return tuple(sorted(varying_axes(x) or (), key=str))
