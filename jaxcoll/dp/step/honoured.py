"""Which roles the model honours: who runs the tensor axis's collectives (the model, or XLA's
partitioner), and the refusal of a layout role the traced model never used.

A layout's roles are promises the model code has to keep: a context role splits every
sequence, so attention must see the whole sequence; a pipeline role splits the model into
stages, so the model must run a pipeline; an expert role holds each device's own experts, so
the tokens must be routed to them. While the step is traced, :mod:`jaxcoll._core.roles`
records the roles the model code asked for (``parallel.context_attention``,
``jax.nn.dot_product_attention`` routed through it, ``parallel.pipeline_loss``,
``parallel.moe_mlp`` and :mod:`jaxcoll.nn`'s layers ask); a role never asked for is refused
before the first step runs: a model that ignores it trains silently wrong.

The tensor role has two keepers. A model that runs its own tensor-parallel collectives
(:mod:`jaxcoll.nn`'s layers, ``parallel.row_parallel``) asks for the tensor axis, and the
step's ``shard_map`` is manual over every axis. A model written for GSPMD (no collectives:
kernels placed by their model specs, XLA inserting the reductions) never asks; the step is
then manual over every axis but the tensor axis, which XLA partitions. Which of the two is
found by tracing the step once with the tensor axis left to XLA: the first request for it
stops that trace (:func:`manual_axes`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from ..._core import roles
from ..._core.roles import Role
from ..._core.typing import PyTree
from ..checks import LossOutputError
from ..layout import BoundLayout, is_spec
from ..specs import restrict

_TRACES = itertools.count()
# jax's cache-keyed context for a trace under a binding. Made once, at import: a context made
# later would change every jit's cache key and recompile the first step.
_CONTEXT = jax.make_user_context(None)


def _fresh_trace() -> Any:
    """A context in which jax's tracing caches miss: the functions the model calls (a jitted
    block, a scan body) are traced again under this binding, so what they ask for is
    recorded (and a trace made under another layout's names is never reused)."""
    return _CONTEXT(("jaxcoll-trace", next(_TRACES)))


@contextlib.contextmanager
def tracing(layout: BoundLayout) -> Iterator[set]:
    """The block traced with ``layout``'s names in force, the roles the model asks for
    recorded (the set yielded), and the floors above's trace hooks entered
    (``roles.ON_TRACE``: ``jax.nn.dot_product_attention`` routed through the context role)."""
    binding = layout.binding
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fresh_trace())
        stack.enter_context(roles.bound(binding))
        used = stack.enter_context(roles.recording())
        for hook in roles.ON_TRACE:
            stack.enter_context(hook(binding))
        yield used


def only(specs: PyTree, manual: frozenset) -> PyTree:
    """``specs`` with only the ``manual`` axes kept: a ``shard_map``'s specs name only the axes
    it is manual over (the others' splits come with the arrays)."""
    axes = tuple(manual)
    return jax.tree_util.tree_map(
        lambda s: s if s is None else restrict(s, axes), specs, is_leaf=is_spec
    )


def _abstract(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x


def manual_axes(
    layout: BoundLayout, build: Callable[[frozenset], Callable], args: tuple
) -> frozenset:
    """The axes the step's ``shard_map`` is manual over: every mesh axis, or every one but the
    tensor axis where the model never asks for it (a GSPMD-style model: XLA partitions it).

    ``build(manual)`` is the per-rank program manual over ``manual``; ``args`` its arguments.
    It is traced once (shapes only) with the tensor axis left to XLA; a model that asks for the
    tensor axis stops that trace at its first request (:class:`roles.ManualRole`)."""
    every = frozenset(layout.mesh.axis_names)
    tensor = layout.layout.tensor_axis
    if tensor is None:
        return every
    auto = every - {tensor}
    try:
        with roles.probing(Role.TENSOR):
            jax.eval_shape(build(auto), *jax.tree_util.tree_map(_abstract, args))
    except roles.ManualRole:
        return every
    return auto


# What each role asks of the model, and the fix, for a role it never used.
_ASKS = {
    Role.CONTEXT: (
        "splits every sequence over {axis!r} ({n} devices), but the model never computed "
        "attention through the context path, so each device would attend only within its "
        "own part of the sequence",
        "compute attention with jax.nn.dot_product_attention(q, k, v, is_causal=True) (the "
        "layout routes it through its context attention), parallel.context_attention or "
        "jaxcoll.nn's attention; or leave context out of the layout",
    ),
    Role.PIPELINE: (
        "splits the model into stages over {axis!r} ({n} devices), but the model never ran a "
        "pipeline, so every stage would run its own slice of the layers as if it were the "
        "whole model",
        "run the stacked layers through parallel.pipeline_loss (see the porting guide's "
        "pipeline recipe); or leave pipeline out of the layout",
    ),
    Role.EXPERT: (
        "places each device's own experts over {axis!r} ({n} devices), but the model never "
        "routed its tokens through the expert exchange, so each device would use only its "
        "own experts",
        "compute the mixture with parallel.moe_mlp or jaxcoll.nn.MoE; or leave expert out of "
        "the layout",
    ),
}


# The primitives that move data between devices (not pvary/pcast, which only retype a value).
_MOVING = frozenset(
    {
        "psum", "psum_invariant", "pmax", "pmin", "ppermute", "all_gather",
        "all_gather_invariant", "all_to_all", "ragged_all_to_all", "reduce_scatter",
        "psum_scatter", "pbroadcast",
    }
)  # fmt: skip
# The collectives that honour a role the model ran by hand (its own lax or primitives calls):
# any over the context or pipeline axis; an exchange over the expert axis (whose devices the
# data shards' gathers use too).
_HONOURS = {
    Role.CONTEXT: _MOVING,
    Role.PIPELINE: _MOVING,
    Role.EXPERT: frozenset({"all_to_all", "ragged_all_to_all"}),
}


def _jaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs inside an equation's parameter (a jaxpr, a closed one, a tuple of them)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs(v)


def collectives(jaxpr: Any) -> set[tuple[str, str]]:
    """``(primitive, mesh axis)`` of every collective in ``jaxpr`` and the jaxprs inside it."""
    found: set[tuple[str, str]] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MOVING:
            axes = eqn.params.get("axis_name", eqn.params.get("axes", ()))
            for a in axes if isinstance(axes, (tuple, list)) else (axes,):
                found.add((eqn.primitive.name, a))
        for v in eqn.params.values():
            for sub in _jaxprs(v):
                found |= collectives(sub)
    return found


def check_honoured(
    api: str,
    layout: BoundLayout,
    used: set,
    traced: Callable[[], Any] | None = None,
) -> None:
    """Raise (as the op that traced the loss) if the layout gives the context, pipeline or
    expert role an axis the traced model never asked for (``used``) and ``traced()`` (the
    loss's jaxpr, traced only then) runs no collective of that role over it (a model running
    the role by hand with lax or jaxcoll's primitives keeps it). (The tensor role is
    kept by the model's own collectives or by XLA's: :func:`manual_axes`; a model that splits
    no param over it is refused at init: :func:`tensor_split`.)"""
    of = {
        Role.CONTEXT: layout.context_axis,
        Role.PIPELINE: layout.layout.pipeline_axis,
        Role.EXPERT: layout.expert_axis,
    }
    found: set | None = None
    for role, axis in of.items():
        if axis is None or role in used:
            continue
        n = layout.mesh.shape[axis] if isinstance(axis, str) else "several"
        if n == 1:
            continue
        if traced is not None:  # a model running the role by hand: its own collectives
            found = collectives(traced().jaxpr) if found is None else found
            if any(p in _HONOURS[role] and a == axis for p, a in found):
                continue
        what, fix = _ASKS[role]
        raise LossOutputError(
            ValueError,
            f"the layout {layout.layout} has a {role} role that "
            f"{what.format(axis=axis, n=n)}: it would train silently wrong. Fix: {fix}.",
        )


def tensor_split(api: str, layout: BoundLayout, model: list[P]) -> None:
    """Raise if the layout has a tensor axis and no param's model spec splits over it: the
    tensor role would replicate the whole model on every device of it."""
    tensor = layout.layout.tensor_axis
    if tensor is None or layout.mesh.shape[tensor] == 1:
        return
    if any(tensor in [a for e in s for a in (e if isinstance(e, tuple) else (e,))] for s in model):
        return
    raise ValueError(
        f"{api}: the layout {layout.layout} has a tensor role over {tensor!r} "
        f"({layout.mesh.shape[tensor]} devices), but no param is split over it: every "
        f"device of it would hold and compute the whole model (and a row-parallel reduction "
        f"would sum {layout.mesh.shape[tensor]} copies). Give the params their tensor splits: "
        f"logical names in the model's sharding metadata (nnx.with_partitioning(init, "
        f"('embed', 'mlp')), nn.with_logical_partitioning), partition rules "
        f"(init(specs=[(r'.*mlp/up/kernel', P(None, 'tensor')), ...])) or specs=; or leave "
        f"tensor out of the layout."
    )


def tensor_pinned(
    loss: Callable, strategy: Any, like: PyTree, layout: BoundLayout, manual: frozenset
) -> Callable:
    """``loss`` with each (whole, gathered) param pinned to its tensor split where XLA
    partitions the tensor axis: without the pin XLA may gather a split kernel whole on every
    device of the axis and repeat the layer's work there (each device holding its slice but
    computing the whole layer); with it, each device computes with its slice, as Megatron's
    layers do, and XLA reduces the partial products. ``loss`` itself where the model runs the
    axis by hand (or there is none)."""
    tensor = layout.layout.tensor_axis
    if tensor is None or tensor in manual:
        return loss
    specs = [restrict(s, (tensor,)) for s in strategy.model_leaf_specs(like)]
    if all(s == P() for s in specs):
        return loss

    def pinned(params: PyTree, *rest: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        leaves = [
            x if s == P() else jax.lax.with_sharding_constraint(x, s)
            for x, s in zip(leaves, specs, strict=True)
        ]
        return loss(jax.tree_util.tree_unflatten(treedef, leaves), *rest)

    return pinned
