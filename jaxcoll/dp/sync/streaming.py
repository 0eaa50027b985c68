"""Streaming DiLoCo: :class:`StreamingDiLoCo`, :class:`~jaxcoll.dp.sync.DiLoCo` whose params
meet by fragments, each fragment's meeting overlapping an inner step.

Douillard et al., *Streaming DiLoCo with overlapping communication: Towards a Distributed
Free Lunch*: the params are cut into fragments that meet one at a time, spread over the
interval (the bytes across replicas at a sync step are a fraction of the params'), and a
fragment's all-reduce overlaps the inner computation (their overlap ``tau``, here 1 step):
its pseudo-gradient is taken from the replicas' params at the *start* of its sync step,
before that step's inner update, so the all-reduce depends on nothing the step's forward and
backward compute and the scheduler may run it beside them; the outer result is merged into
the replicas' params at the end of the step, after the inner update, by the paper's rule
``local = mixing * local + (1 - mixing) * global``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jax
import numpy as np

from ..._core.typing import PyTree
from .base import is_spec, mirror_specs
from .semisync import DiLoCo, _stack


@dataclass(frozen=True, kw_only=True)
class StreamingDiLoCo(DiLoCo):
    """:class:`DiLoCo` whose params meet by fragments, one fragment at a time, the meetings
    spread over the interval, each overlapping an inner step: the bytes across replicas per
    sync step are a fraction of the params', and they travel beside the step's computation
    (Douillard et al., *Streaming DiLoCo with overlapping communication*, overlap 1 step).

    The params' leaves, in leaf order, are cut into ``fragments`` contiguous groups of about
    equal size (a leaf goes to the fragment its middle element falls in:
    ``floor((start + size / 2) * fragments / total)``, ``start`` the number of elements of
    the leaves before it). Fragment ``p`` meets at the steps where
    ``(step - warmup + 1 + p * every // fragments) % every == 0`` (fragment 0 where DiLoCo
    meets).
    Equivalent to (``frag``: the fragment's leaves; the inner step as :class:`DiLoCo`'s)::

        # at the start of a step where fragment p meets (overlap=True):
        start = [local[r][frag] for r in range(R)]      # before this step's inner update
        delta = params[frag] - mean(start)              # its all-reduce: no data dependence
        ... every replica's inner step, as at any step ...
        u, outer_state[p] = outer.update(delta, outer_state[p], params[frag])
        params[frag] = optax.apply_updates(params[frag], u)
        for r in range(R):                              # the paper's merge, after the step
            local[r][frag] = mixing * local[r][frag] + (1 - mixing) * params[frag]

    With ``overlap=False`` the pseudo-gradient is taken after the step's inner update
    (``start`` is the updated params): the all-reduce waits for the step's gradients, and
    ``fragments=1`` is then :class:`DiLoCo`. With ``overlap=True`` and ``mixing=0`` the
    fragment's part of its sync step's inner update is replaced by the new global params
    (the paper's rule with ``alpha = 0``); ``mixing > 0`` keeps that share of it.
    ``opt_state.outer`` is a tuple with one outer state per fragment (of the list of its
    leaves).

    Args:
        inner: as :class:`DiLoCo`'s.
        every: the steps between two meetings of each fragment (a positive int).
        outer: as :class:`DiLoCo`'s.
        quantize: as :class:`DiLoCo`'s: each fragment's pseudo-gradient sent in 8 bits.
        warmup: as :class:`DiLoCo`'s: the synchronous steps before the first inner one.
        fragments: the number of fragments, from 1 to ``every``; at most the number of
            leaves of the params (checked at ``Trainer.init``).
        mixing: how much of its own params a replica keeps at a meeting (the paper's
            alpha), in [0, 1); 0 (default): it takes the global params.
        overlap: True (default): a fragment's all-reduce overlaps its sync step's inner
            step (the pseudo-gradient from the params before it); False: it follows it.

    Example (8 devices: 2 replicas of 4)::

        >>> sync = dp.sync.StreamingDiLoCo(every=32, fragments=4)   # a fragment every 8 steps
    """

    grad_route: ClassVar[str] = (
        "averaged within each replica every step and across replicas by fragments every few "
        "steps (StreamingDiLoCo)"
    )

    fragments: int = 2
    mixing: float = 0.0
    overlap: bool = True
    _fragment: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        api, k = self.api, self.fragments
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(
                f"{api}: fragments must be an int, got {k!r} of type {type(k).__name__} instead."
            )
        if not 1 <= k <= self.every:
            raise ValueError(
                f"{api}: fragments={k} must be between 1 and every={self.every} (each "
                f"fragment meets at its own step of the interval)."
            )
        a = self.mixing
        if isinstance(a, bool) or not isinstance(a, numbers.Real):
            raise TypeError(
                f"{api}: mixing must be a number in [0, 1), got {a!r} of type "
                f"{type(a).__name__} instead."
            )
        if not 0 <= a < 1:
            raise ValueError(
                f"{api}: mixing={a!r} must be in [0, 1) (the share of its own params a "
                f"replica keeps at a meeting; 0: none)."
            )
        if not isinstance(self.overlap, bool):
            raise TypeError(
                f"{api}: overlap must be True or False, got {self.overlap!r} of type "
                f"{type(self.overlap).__name__} instead."
            )

    def _schedule(self, step: int) -> None:
        """Fragment ``p`` meets at step ``step`` (counted from the first inner one) where
        ``(step + 1 + p * every // fragments) % every == 0``; none: the inner step's."""
        k, h = self.fragments, self.every
        meets = [p for p in range(k) if (step + 1 + p * h // k) % h == 0]
        object.__setattr__(self, "_sync", bool(meets))
        object.__setattr__(self, "_fragment", meets[0] if meets else None)

    def fragment_leaves(self, params: PyTree) -> list[list[int]]:
        """The indices of the leaves of ``params`` in each fragment (leaf order).

        Raises:
            ValueError: a fragment would have no leaf (fewer leaves than fragments, or one
                leaf much larger than the others).
        """
        sizes = [int(np.size(x)) for x in jax.tree_util.tree_leaves(params)]
        total, start = max(sum(sizes), 1), 0
        out: list[list[int]] = [[] for _ in range(self.fragments)]
        for i, size in enumerate(sizes):
            p = min(int((start + size / 2) * self.fragments // total), self.fragments - 1)
            out[p].append(i)
            start += size
        empty = [p for p, f in enumerate(out) if not f]
        if empty:
            raise ValueError(
                f"{self.api}: fragments={self.fragments} leaves fragment {empty[0]} without "
                f"a param (the params have {len(sizes)} leaves of sizes {sizes}); use fewer "
                f"fragments."
            )
        return out

    def _split(self, tree: PyTree, params: PyTree) -> list[list[Any]]:
        leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_spec)
        return [[leaves[i] for i in f] for f in self.fragment_leaves(params)]

    def outer_init(self, params: PyTree) -> PyTree:
        """One outer state per fragment, of the list of its leaves."""
        return tuple(self.outer.init(f) for f in self._split(params, params))

    def outer_specs(self, outer_state: PyTree, params: PyTree) -> PyTree:
        """Each fragment's outer state placed like its leaves of the global params."""
        specs = self._split(self.state_param_specs(params), params)
        return tuple(
            mirror_specs(state, f, s)
            for state, f, s in zip(outer_state, self._split(params, params), specs, strict=True)
        )

    def meet(
        self, params: PyTree, local: PyTree, outer: PyTree, start: PyTree = None
    ) -> tuple[PyTree, PyTree, Any]:
        """Fragment :attr:`_fragment` meets: the outer step on its leaves with the replicas'
        mean of ``start`` (their params before this step's inner update; of ``local``, after
        it, without :attr:`overlap`), then its leaves of ``local`` mixed with the new global
        ones; the other leaves untouched."""
        f = self._fragment
        if f is None:
            raise RuntimeError(f"{self.api}: meet runs in a fragment's phase: .phase(step).")
        index = self.fragment_leaves(params)[f]
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        l_leaves = jax.tree_util.tree_leaves(local)
        sent = jax.tree_util.tree_leaves(start if self.overlap and start is not None else local)
        specs = jax.tree_util.tree_leaves(self.state_param_specs(params), is_leaf=is_spec)
        # The fragment's params cross replicas here (its mean over the replicate axis). With
        # overlap they are the step's inputs: the all-reduce does not wait for its gradients.
        mean = self.replica_mean(
            [p_leaves[i] for i in index], [sent[i] for i in index], [specs[i] for i in index]
        )
        new, state = self.outer_step([p_leaves[i] for i in index], mean, outer[f])
        a = self.mixing
        for i, x in zip(index, new, strict=True):
            p_leaves[i] = x
            mixed = _stack(x, self.replicas) if a == 0 else a * l_leaves[i] + (1 - a) * x[None]
            l_leaves[i] = mixed.astype(x.dtype)
        outer = (*outer[:f], state, *outer[f + 1 :])
        unflat = jax.tree_util.tree_unflatten
        return unflat(treedef, p_leaves), unflat(treedef, l_leaves), outer
