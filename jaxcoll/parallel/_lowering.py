"""What every pipeline schedule's lowering takes: the staged model and its data on one stage."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import jax

from .._core.typing import PyTree
from .._core.vma import varying_axes


@dataclass(frozen=True)
class Staged:
    """A stage's part of a pipelined model, as the lowerings (GPipe, 1F1B, interleaved,
    ZB-H1) run it. Each returns ``(loss, grads, d_head, d_xs)``: the last stage's mean loss (0
    or garbage elsewhere), this stage's gradient summed over micro-batches of the mean loss,
    the head's gradient (the last stage's, zero elsewhere) and the inputs' (stage 0's)."""

    stage_fn: Callable
    """``(stage params, h) -> h``, or ``(stage params, h, side) -> h`` with side inputs (call
    it by :meth:`stage`)."""
    loss_fn: Callable
    """``(head, out, y) -> mean loss`` of one micro-batch (run on the last stage)."""
    own: PyTree
    """This stage's params (leading axis v for the interleaved schedule)."""
    xs: jax.Array
    """The inputs, ``(M, micro-batch, ...)`` (read by stage 0)."""
    ys: PyTree
    """The targets, every leaf ``(M, micro-batch, ...)`` (read by the last stage)."""
    stage_axis: Hashable
    head: PyTree = ()
    """The head's params (``()``: none)."""
    sides: PyTree = None
    """The side inputs, every leaf ``(M, micro-batch, ...)`` (read by every stage: each
    holds the replica's whole batch), or None: ``stage_fn`` takes none."""

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


def side_at(sides: PyTree, k: Any) -> PyTree:
    """Micro-batch ``k`` of the side inputs ``sides`` (``(M, micro-batch, ...)`` leaves), or
    None where there are none."""
    return None if sides is None else jax.tree_util.tree_map(lambda v: v[k], sides)


def call_stage(stage_fn: Callable, params: PyTree, h: jax.Array, side: PyTree) -> jax.Array:
    """``stage_fn(params, h)``, or ``stage_fn(params, h, side)`` where ``side`` is not None."""
    return stage_fn(params, h) if side is None else stage_fn(params, h, side)


def axes_of(x: Any) -> tuple:
    """The mesh axes ``x`` varies over (shard_map's type), sorted."""
    return tuple(sorted(varying_axes(x) or (), key=str))
