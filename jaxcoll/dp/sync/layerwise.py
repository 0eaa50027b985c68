"""FSDP's per-layer gathering: the loss's scans over stacked params gather one layer at a time.

A deep model is written as a scan over layers whose params are stacked along a leading layer
axis (flax ``nn.scan`` / ``nnx.scan`` with ``variable_axes={"params": 0}``, or ``lax.scan``
over a stacked pytree). FSDP holds each stacked leaf split along a dimension after the layer
axis, so every layer's slice is itself split over the devices. :func:`gather_per_layer` runs
the loss on the params as held: it traces the loss once (``jax.make_jaxpr``, in the caller's
trace, so the shard_map's types stay on) with the whole params as FSDP's gather produces them,
then evaluates that program equation by equation, with each gathered param kept *lazy* (its
slice, not yet gathered):

* a ``scan`` that takes lazy params among its scanned inputs (``xs``) gets the slices
  instead, and its body gathers its own layer at the start of each iteration: the forward
  holds one gathered layer at a time; the body is rematerialised without saving the gathered
  layer, so the backward gathers each layer again where it needs it, and the gather's
  gradient reduce-scatters that layer's gradient as soon as the iteration has it;
* calls (``jit`` inside the loss, ``jax.checkpoint``) are entered the same way, so a scan
  inside them is found; a ``jax.checkpoint`` keeps its policy;
* any other use of a lazy param gathers it whole there, once per scope (a tied embedding used
  twice is gathered once).

The program is the user's: nothing but where the params are gathered changes, so the result
is the same function of the params; the rewrite is checked by the FSDP equivalence tests
against single-device training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax

from ..._jax import CALLS, Literal, jaxpr_parts, scan_counts
from .buckets import plan_buckets
from .regather import forward_token, regathered, tie

#: Gathers lazy params: ``gather(slices, dims) -> wholes`` (FSDP's differentiable
#: all-gather, batched: the params a scope gathers are gathered together).
Gather = Callable[[list[jax.Array], list[int]], list[jax.Array]]

_REMAT = "remat2"
_SCAN = "scan"
#: The block a scan's layer belongs to (:attr:`Lazy.unit`): its params are gathered as a
#: block's are, each matrix in a buffer of its own (:func:`_parts`).
_LAYER = -1


@dataclass(eq=False)
class Lazy:
    """A param not gathered yet: this rank's ``slice`` of it, split along ``dim``."""

    slice: jax.Array
    dim: int
    unit: int | None = (
        None  # the repeated block it belongs to (:func:`~jaxcoll.dp.sync.blocks.block_units`)
    )


@dataclass(frozen=True)
class _Config:
    gather: Gather
    policy: Callable[..., bool]
    bucket_bytes: float | None  # the gathered bytes of one group of params
    n: int  # the number of slices of a split param
    remat: bool  # segments rematerialised (the backward gathers their params again)
    prefetch: bool  # a segment's re-gather may start in the next segment's backward


class _Scope:
    """The values of one jaxpr's variables. The lazy params this jaxpr uses whole are
    gathered in groups of about ``bucket_bytes``, in the order of their first use, each group
    at the first use of one of its params (one differentiable gather per group, so the
    backward reduce-scatters a group's gradients as soon as they all exist)."""

    def __init__(self, config: _Config) -> None:
        self.env: dict[Any, Any] = {}
        self.config = config
        self.wholes: dict[int, jax.Array] = {}  # id(Lazy) -> the gathered param
        self.group_of: dict[int, list[Lazy]] = {}  # id(Lazy) -> the params gathered with it

    def read(self, v: Any) -> Any:
        if isinstance(v, Literal):
            return v.val
        return self.env[v]

    def lazy(self, v: Any) -> Lazy | None:
        x = None if isinstance(v, Literal) else self.env.get(v)
        return x if isinstance(x, Lazy) else None

    def forced(self, eqn: Any) -> list[Lazy]:
        """The lazy params ``eqn`` uses whole (all but those it only passes to a scan over
        their layers or into a call that is entered)."""
        name = str(eqn.primitive)
        if name in CALLS or name == _REMAT:
            return []
        if name == _SCAN:
            nc, nk = scan_counts(eqn.params)
            out = [self.lazy(v) for v in eqn.invars[: nc + nk]]
            out += [
                x for x in map(self.lazy, eqn.invars[nc + nk :]) if x is not None and x.dim == 0
            ]
        else:
            out = [self.lazy(v) for v in eqn.invars]
        return [x for x in out if x is not None]

    def plan(self, eqns: Sequence[Any], outvars: Sequence[Any]) -> None:
        """Group the lazy params ``eqns`` and ``outvars`` use whole (see the class)."""
        seen: dict[int, Lazy] = {}
        for eqn in eqns:
            for x in self.forced(eqn):
                seen.setdefault(id(x), x)
        for v in outvars:
            out = self.lazy(v)
            if out is not None:
                seen.setdefault(id(out), out)
        order = list(seen.values())  # first use first
        for group in _groups(order, self.config):
            self.group_of.update({id(z): group for z in group})

    def value(self, v: Any) -> Any:
        """The value of ``v``; a lazy param gathered (with the rest of its group)."""
        x = self.read(v)
        if not isinstance(x, Lazy):
            return x
        if id(x) not in self.wholes:
            group = [z for z in self.group_of.get(id(x), [x]) if id(z) not in self.wholes]
            for part in _parts(group):
                wholes = self.config.gather([z.slice for z in part], [z.dim for z in part])
                self.wholes.update({id(z): w for z, w in zip(part, wholes, strict=True)})
        return self.wholes[id(x)]


def gather_per_layer(
    fn: Callable[..., Any],
    gather: Gather,
    dims: Sequence[int | None],
    whole: Callable[[list[jax.Array]], list[jax.Array]],
    policy: Callable[..., bool],
    bucket_bytes: float | None,
    n: int,
    remat: bool = True,
    units: Sequence[int | None] | None = None,
    prefetch: bool = True,
) -> Callable[..., Any]:
    """``fn(params, *rest)`` as a function of the params as held (``run(held, *rest)``),
    gathering each stacked layer inside the scan that uses it.

    Args:
        fn: the loss of the whole params.
        gather: ``gather(slices, dims) -> wholes``, differentiable (its gradient is the
            reduce-scatter of the mean).
        dims: per param leaf (in ``jax.tree_util`` order), the dimension it is split along,
            or None (replicated).
        whole: the gather of every param leaf at once (``gather`` per split leaf), traced
            to give the loss its inputs' types; the equations it adds are replaced by lazy
            params, never run as they are.
        policy: the rematerialisation policy of a rewritten scan's body: it must not save
            the gathered params (the backward gathers them again).
        bucket_bytes: the gathered bytes of one group of params (gathered together, in the
            order the loss first uses them); None: one param per group.
        n: the number of slices a split param is cut into.
        remat: rematerialise each segment of the loss between two groups' first uses
            (``jax.checkpoint`` with ``policy``), so the backward gathers each group again
            when it reaches it (torch FSDP's ``reshard_after_forward``); False: the gathered
            params are kept for the backward. A scan's body over layers is rematerialised
            either way.
        units: per param leaf, the repeated block it belongs to
            (:func:`~jaxcoll.dp.sync.blocks.block_units`) or None: a group of params
            gathered together never spans two blocks.
        prefetch: with ``remat``, a segment's re-gather may start while the next
            segment's backward computes (:mod:`~jaxcoll.dp.sync.regather`); False: when
            its own cotangent has arrived.
    """
    config = _Config(gather, policy, bucket_bytes, n, remat, prefetch)

    def run(params: Any, *rest: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(params)

        def traced(leaves, *rest):
            return fn(jax.tree_util.tree_unflatten(treedef, whole(leaves)), *rest)

        closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(leaves, *rest)
        flat_rest = jax.tree_util.tree_leaves(rest)
        jaxpr = closed.jaxpr
        n = len(leaves)
        scope = _Scope(config)
        for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
            scope.env[v] = c
        for v, x in zip(jaxpr.invars, [*leaves, *flat_rest], strict=True):
            scope.env[v] = x
        # The whole(...) gathers are the equations whose input is a split param: their
        # outputs become lazy params (this rank's slice).
        param_vars = {v: (leaves[i], d) for i, (v, d) in enumerate(zip(jaxpr.invars[:n], dims))}
        unit_of = dict(zip(jaxpr.invars[:n], units or [None] * n, strict=True))
        eqns = []
        for eqn in jaxpr.eqns:
            ins = [v for v in eqn.invars if not isinstance(v, Literal)]
            if (
                len(ins) == 1
                and len(eqn.outvars) == 1
                and ins[0] in param_vars
                and param_vars[ins[0]][1] is not None
                and str(eqn.primitive) in ("custom_vjp_call", "custom_vjp_call_jaxpr")
            ):
                x, d = param_vars[ins[0]]
                scope.env[eqn.outvars[0]] = Lazy(x, int(d), unit_of[ins[0]])  # type: ignore[arg-type]
            else:
                eqns.append(eqn)
        outs = _eval_segments(eqns, jaxpr.outvars, scope)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return run


def _segments(eqns: Sequence[Any], scope: _Scope) -> list[list[Any]]:
    """``eqns`` cut where the next group of params (:func:`_groups`) is first used whole:
    each segment gathers one group (one block's params, about ``bucket_bytes`` at most)."""
    order: dict[int, Lazy] = {}
    for eqn in eqns:
        for x in scope.forced(eqn):
            order.setdefault(id(x), x)
    group = {id(x): k for k, g in enumerate(_groups(list(order.values()), scope.config)) for x in g}
    segments: list[list[Any]] = [[]]
    held: set[int] = set()
    for eqn in eqns:
        new = {group[id(x)] for x in scope.forced(eqn)} - held
        if new and held:
            segments.append([])
            held = set()
        held |= new
        segments[-1].append(eqn)
    return segments


def _parts(group: list[Lazy]) -> list[list[Lazy]]:
    """The gathers of one group: a block's params (:attr:`Lazy.unit`; a scan's layer is one)
    one per matrix (two dimensions or more) and one for the rest (biases, norms' scales),
    other groups whole.

    A gathered buffer lives as long as any value read from it: XLA fuses a cheap op of the
    forward (a bias add, a norm's scale) into the backward's fusion that needs its result,
    which then reads the forward's buffer instead of the one gathered again, keeping the
    whole buffer (a whole block's params, were they one buffer) alive from the forward into
    the backward. And a packed buffer is copied out of, leaf by leaf, so the gathered
    buffer and the copies live together (a scan's layer packed whole held a layer more: 4
    MiB at 8 layers of width 256). A matrix in a buffer of its own is read by the matmuls
    that use it alone; the small params share one buffer."""
    if group[0].unit is None:
        return [group]
    big = [[x] for x in group if x.slice.ndim >= 2]
    rest = [x for x in group if x.slice.ndim < 2]
    return big + ([rest] if rest else [])


def _groups(order: Sequence[Lazy], config: _Config) -> list[list[Lazy]]:
    """The lazy params ``order`` (in the order of their first use) in the groups that are
    gathered together: consecutive params of one block (:attr:`Lazy.unit`; the params of no
    block together) in buckets of about ``bucket_bytes`` (one param each with None). A group
    never spans two blocks, so an unrolled model gathers (and gathers again in the backward)
    one block at a time whatever the bucket size."""
    runs: list[list[Lazy]] = []
    for x in order:
        if runs and runs[-1][0].unit == x.unit:
            runs[-1].append(x)
        else:
            runs.append([x])
    n = config.n
    groups: list[list[Lazy]] = []
    for run in runs:
        wholes = [jax.ShapeDtypeStruct((x.slice.size * n,), x.slice.dtype) for x in reversed(run)]
        # plan_buckets groups from the end of its list: the reversed order groups from the
        # first use on.
        for bucket in plan_buckets(wholes, config.bucket_bytes):
            groups.append([run[len(run) - 1 - i] for i in bucket])
    return groups


def _eval_segments(eqns: Sequence[Any], outvars: Sequence[Any], scope: _Scope) -> list[Any]:
    """``eqns`` evaluated segment by segment (:func:`_segments`), each segment a
    ``jax.checkpoint`` with the policy that saves everything but gathered params: each
    segment gathers the params it uses, and the backward gathers them again segment by
    segment, as torch's FSDP does module by module, instead of all at once. With
    ``config.remat`` off, or one segment, the eqns are evaluated as they are."""
    segments = _segments(eqns, scope) if scope.config.remat else [list(eqns)]
    if len(segments) == 1 and not scope.config.remat:
        scope.plan(eqns, outvars)
        return _eval(eqns, outvars, scope)
    # Which variables each segment must return: those used after it.
    later: list[set[Any]] = [set() for _ in segments]
    used_after = {v for v in outvars if not isinstance(v, Literal)}
    for k in range(len(segments) - 1, -1, -1):
        later[k] = set(used_after)
        for eqn in segments[k]:
            used_after.update(v for v in eqn.invars if not isinstance(v, Literal))
    link = None  # the backward's prefetch: see regather.py
    before = None  # the previous segment's inputs, as one token (the forward's gathers wait)
    for k, segment in enumerate(segments):
        defined = [v for eqn in segment for v in eqn.outvars]
        own = set(defined)
        inputs = list(
            dict.fromkeys(
                v
                for eqn in segment
                for v in eqn.invars
                if not isinstance(v, Literal) and v not in own
            )
        )
        outputs = [v for v in defined if v in later[k]]
        args = [scope.read(v) for v in inputs]
        lazy = {i: a for i, a in enumerate(args) if isinstance(a, Lazy)}

        def run(*xs, segment=segment, inputs=inputs, outputs=outputs, lazy=lazy):
            inner = _Scope(scope.config)
            for i, (v, x) in enumerate(zip(inputs, xs, strict=True)):
                inner.env[v] = _like(lazy[i], x) if i in lazy else x
            inner.plan(segment, outputs)
            return _eval(segment, outputs, inner)

        flat = [a.slice if isinstance(a, Lazy) else a for a in args]
        # The forward's gathers wait too (torch FSDP's limit_all_gathers): a segment's
        # gather starts once the previous segment's inputs exist (with prefetch: it may
        # overlap that segment's compute), or its own's, so XLA cannot hoist every block's
        # gather to the top of the step (XLA:GPU's combiners merge them all into one there).
        mine = forward_token([a for a in args if not isinstance(a, Lazy)])
        wait = before if scope.config.prefetch else mine
        if k > 0 and wait is not None:
            flat = [tie(x, wait) if i in lazy else x for i, x in enumerate(flat)]
        before = mine
        # A param a scan gathers layer by layer is gathered again by the backward's loop,
        # which XLA cannot merge with the forward's: only the others are tied.
        tied = [i for i in sorted(lazy) if not _layered_only(inputs[i], segment, scope)]
        # The last two segments tie to their own cotangent: the last one's is the loss's
        # seed, known in the forward already, so a re-gather tied to it would be merged
        # with the forward's gather.
        outs, link = regathered(
            run,
            scope.config.policy,
            flat,
            tied,
            link,
            last=k >= len(segments) - 2 or not scope.config.prefetch,
        )
        for v, x in zip(outputs, outs, strict=True):
            scope.env[v] = x
    scope.plan([], outvars)
    return [scope.value(v) for v in outvars]


def _layered_only(v: Any, eqns: Sequence[Any], scope: _Scope) -> bool:
    """Whether every use of the lazy param ``v`` in ``eqns`` is a scan over its layers."""
    for eqn in eqns:
        if v not in eqn.invars:
            continue
        if str(eqn.primitive) != _SCAN:
            return False
        nc, nk = scan_counts(eqn.params)
        if v in eqn.invars[: nc + nk] or any(x is scope.lazy(v) for x in scope.forced(eqn)):
            return False
    return True


def _eval(eqns: Sequence[Any], outvars: Sequence[Any], scope: _Scope) -> list[Any]:
    for eqn in eqns:
        name = str(eqn.primitive)
        lazy_in = any(isinstance(scope.read(v), Lazy) for v in eqn.invars)
        if lazy_in and name == _SCAN:
            outs = _scan(eqn, scope)
        elif lazy_in and name in CALLS:
            inner = eqn.params[CALLS[name]]
            outs = _run_inner(inner, [scope.read(v) for v in eqn.invars], scope, segmented=True)
        elif lazy_in and name == _REMAT:
            outs = _remat(eqn, [scope.read(v) for v in eqn.invars], scope)
        else:
            outs = _bind(eqn, [scope.value(v) for v in eqn.invars])
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            scope.env[v] = x
    return [scope.value(v) for v in outvars]


def _like(lazy: Lazy, x: jax.Array) -> Lazy:
    """The slice ``x`` as a lazy param like ``lazy`` (its dimension and block)."""
    return Lazy(x, lazy.dim, lazy.unit)


def _bind(eqn: Any, args: Sequence[Any]) -> Any:
    """The equation applied to ``args``, as ``jax.core.eval_jaxpr`` applies it."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    ctx = getattr(eqn, "ctx", None)
    if ctx is None:
        return eqn.primitive.bind(*subfuns, *args, **params)
    with ctx.manager:
        return eqn.primitive.bind(*subfuns, *args, **params)


def _run_inner(
    inner: Any, args: Sequence[Any], outer: _Scope, *, segmented: bool = False
) -> list[Any]:
    """An inner jaxpr (a call's, a scan's body) evaluated on ``args``, lazy ones included."""
    jaxpr, consts = jaxpr_parts(inner)
    scope = _Scope(outer.config)
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        scope.env[v] = c
    for v, x in zip(jaxpr.invars, args, strict=True):
        scope.env[v] = x
    if segmented:
        return _eval_segments(jaxpr.eqns, jaxpr.outvars, scope)
    scope.plan(jaxpr.eqns, jaxpr.outvars)
    return _eval(jaxpr.eqns, jaxpr.outvars, scope)


def _remat(eqn: Any, args: Sequence[Any], outer: _Scope) -> list[Any]:
    """A ``jax.checkpoint`` entered, keeping its policy: the lazy params are its slices."""
    p = eqn.params
    lazy = {i: a for i, a in enumerate(args) if isinstance(a, Lazy)}

    def body(*xs):
        full = [_like(lazy[i], x) if i in lazy else x for i, x in enumerate(xs)]
        return _run_inner(p["jaxpr"], full, outer)

    flat = [a.slice if isinstance(a, Lazy) else a for a in args]
    f = jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True), policy=p.get("policy"))
    return list(f(*flat))


def _scan(eqn: Any, scope: _Scope) -> list[Any]:
    """A scan whose scanned inputs include lazy params: it scans their slices, and each
    iteration gathers its own layer (rematerialised: the backward gathers it again)."""
    p = eqn.params
    nc, nk = scan_counts(p)
    args = [scope.read(v) for v in eqn.invars]
    consts = [scope.value(v) for v in eqn.invars[:nc]]
    carry = [scope.value(v) for v in eqn.invars[nc : nc + nk]]
    xs_in = args[nc + nk :]
    layered: dict[int, int] = {}
    xs: list[Any] = []
    for i, (v, a) in enumerate(zip(eqn.invars[nc + nk :], xs_in, strict=True)):
        if isinstance(a, Lazy) and a.dim >= 1:
            layered[i] = a.dim - 1  # the split dimension within one layer
            xs.append(a.slice)
        else:
            xs.append(scope.value(v))
    body_jaxpr = p["jaxpr"]

    def body(carry, x):
        x = [Lazy(xi, layered[i], _LAYER) if i in layered else xi for i, xi in enumerate(x)]
        outs = _run_inner(body_jaxpr, [*consts, *carry, *x], scope)
        return outs[:nk], outs[nk:]

    carry, ys = lax.scan(
        jax.checkpoint(body, policy=scope.config.policy),
        carry,
        xs,
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    return [*carry, *ys]
