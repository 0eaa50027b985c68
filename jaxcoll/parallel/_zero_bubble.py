"""The lowering of :class:`~jaxcoll.parallel.ZeroBubble` (ZB-H1): a table of F, B and W slots.

The schedule's :meth:`~jaxcoll.parallel.ZeroBubble.table` is computed on the host and baked
into the program as two small int arrays (operation and micro-batch, stage x slot). One
``lax.scan`` runs its slots; in each, every stage runs its own entry (a ``lax.switch``:
nothing, a forward (the last stage's with the head, a branch of its own so that the other
stages skip the head's FLOPs), B or W), then one ``sendrecv`` moves every forward's output one
stage up and one moves every B's input gradient one stage down.

B and W are the two halves of one backward (:class:`_Split`): the stage's vjp is traced once
as a jaxpr and cut, equation by equation (a ``scan`` over layers cut into two scans), into
what the input's gradient needs, which B runs after recomputing the forward from the kept
stage input, and the rest, the params' gradient, which W runs from what B saved for it (each
layer's inputs and output cotangents: those of the weight-gradient matmuls). So a micro-batch
costs a stage one forward, one recomputed forward and one backward, as 1F1B's does; W
recomputes nothing. What arrives is kept by micro-batch until the stage's B (stage inputs,
output cotangents), what B saves for W until its W (:func:`kept_for_w` buffers).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import primitives
from .._core.typing import PyTree
from .._core.vma import cast_varying
from .._jax import Literal, jaxpr_parts, scan_counts, varying_of
from ._lowering import Staged, axes_of

IDLE, FORWARD, BACKWARD, WEIGHT, HEAD = 0, 1, 2, 3, 4
_KINDS = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}
_SCAN = "scan"


def tables(rows: list) -> tuple[np.ndarray, np.ndarray]:
    """``(kind, micro-batch)``: the table as arrays (stage x slot)."""
    stages, slots = len(rows), len(rows[0])
    kind = np.zeros((stages, slots), np.int32)
    mb = np.zeros((stages, slots), np.int32)
    for s, row in enumerate(rows):
        for t, op in enumerate(row):
            if op is not None:
                kind[s, t], mb[s, t] = _KINDS[op[0]], op[1]
    return kind, mb


def kept_for_w(rows: list) -> int:
    """The most micro-batches a stage has run B of and not yet W (what B saves for W is kept
    that long; micro-batch i in buffer i mod this, B's and W's being in micro-batch order)."""
    most = 1
    for row in rows:
        live = 0
        for op in row:
            live += int(op is not None and op[0] == "B")
            most = max(most, live)
            live -= int(op is not None and op[0] == "W")
    return most


# ------------------------------------------------------------------ the backward, cut in two


def _atoms(vs: Any) -> list:
    """The variables among ``vs`` (not the literals)."""
    return [v for v in vs if not isinstance(v, Literal)]


def _live(eqns: list, needed: set, skip: list[bool] | None = None) -> list[bool]:
    """Which of ``eqns`` compute something in ``needed`` (which grows by their inputs), last
    first; ``skip``: equations the other half runs (their outputs stay in ``needed``)."""
    live = [False] * len(eqns)
    for i in reversed(range(len(eqns))):
        if (skip is None or not skip[i]) and any(v in needed for v in eqns[i].outvars):
            live[i] = True
            needed.update(_atoms(eqns[i].invars))
    return live


def _bind(eqn: Any, args: list) -> list:
    """The equation applied to ``args``, as ``jax.core.eval_jaxpr`` applies it."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    ctx = getattr(eqn, "ctx", None)
    if ctx is None:
        out = eqn.primitive.bind(*subfuns, *args, **params)
    else:
        with ctx.manager:
            out = eqn.primitive.bind(*subfuns, *args, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, Literal) else env[v]


def _run(eqns: list, which: list[bool], env: dict) -> None:
    for eqn, on in zip(eqns, which, strict=True):
        if on:
            env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))


class _ScanCut:
    """A ``scan`` of the vjp that B needs part of (the backward over a stage's layers: the
    carried cotangent): B runs that part, exporting iteration by iteration what the rest
    reads of it (a layer's output cotangent, ...); W runs the rest (the weight-gradient
    matmuls) in a scan of its own over the exports, of the same length and direction."""

    def __init__(self, eqn: Any, need: list[bool]) -> None:
        p = eqn.params
        self.eqn, self.length, self.reverse, self.unroll = (
            eqn,
            p["length"],
            p["reverse"],
            p["unroll"],
        )
        self.body, self.consts = jaxpr_parts(p["jaxpr"])
        self.nc, self.nk = scan_counts(p)
        body, nc, nk = self.body, self.nc, self.nk
        carry = list(need[:nk])
        while True:  # B's carries: those it needs, and those they need (a fixed point)
            needed = set(_atoms(v for v, n in zip(body.outvars, carry + need[nk:]) if n))
            self.b_live = _live(body.eqns, needed)
            grown = [c or body.invars[nc + i] in needed for i, c in enumerate(carry)]
            if grown == carry:
                break
            carry = grown
        self.b_carry = carry
        # The consts and scanned inputs B's part reads, by their place among the scan's inputs.
        self.b_ins = [i for i, v in enumerate(body.invars) if v in needed and not nc <= i < nc + nk]
        self.b_computed = {body.invars[nc + i] for i, c in enumerate(carry) if c}
        self.b_computed |= {v for e, on in zip(body.eqns, self.b_live) if on for v in e.outvars}
        self.b_has = self.b_computed | {body.invars[i] for i in self.b_ins}
        self.b_ys = [j for j in range(len(body.outvars) - nk) if need[nk + j]]
        self.exports: list = []
        self.w_outs: list[int] = []
        self.w_carry = [False] * nk
        self.w_ins: list[int] = []
        self.w_live = [False] * len(body.eqns)

    def b_reads(self) -> list:
        """The scan's inputs B's part reads (the initial values of its carries among them)."""
        ins, nc = self.eqn.invars, self.nc
        return [ins[i] for i in self.b_ins] + [ins[nc + i] for i, c in enumerate(self.b_carry) if c]

    def b_computes(self, j: int) -> bool:
        """Whether B's part has the scan's output ``j`` (or can export it at no cost)."""
        if j < self.nk:
            return self.b_carry[j]
        v = self.body.outvars[j]
        return isinstance(v, Literal) or v in self.b_has

    def plan_w(self, wanted: list[int]) -> list:
        """The outputs ``wanted`` by W: B's part returns those it has, W's part computes the
        others. Returns the scan's inputs W's part reads."""
        body, nc, nk = self.body, self.nc, self.nk
        for j in wanted:
            if j >= nk and self.b_computes(j) and j - nk not in self.b_ys:
                self.b_ys.append(j - nk)
        wanted = [j for j in wanted if not self.b_computes(j)]
        if not wanted:
            return []
        carry = [j in wanted for j in range(nk)]
        while True:  # W's carries (a fixed point, as B's)
            outs = [j for j in range(len(body.outvars)) if j in wanted or (j < nk and carry[j])]
            needed = set(_atoms(body.outvars[j] for j in outs))
            self.w_live = _live(body.eqns, needed, skip=self.b_live)
            grown = [
                c or (not self.b_carry[i] and body.invars[nc + i] in needed)
                for i, c in enumerate(carry)
            ]
            if grown == carry:
                break
            carry = grown
        self.w_carry, self.w_outs = carry, outs
        self.w_ins = [i for i, v in enumerate(body.invars) if v in needed and not nc <= i < nc + nk]
        # What W's part reads of B's (in the order computed): exported per iteration.
        order = [body.invars[nc + i] for i in range(nk)]
        order += [v for e in body.eqns for v in e.outvars]
        self.exports = [v for v in order if v in needed and v in self.b_computed]
        ins = self.eqn.invars
        return [ins[i] for i in self.w_ins] + [ins[nc + i] for i, c in enumerate(carry) if c]

    def _inner(self, which: list[int], values: list) -> dict:
        env = dict(zip(self.body.constvars, self.consts))
        env.update(zip([self.body.invars[i] for i in which], values))
        return env

    def run_b(self, env: dict) -> None:
        ins, body, nc, nk = self.eqn.invars, self.body, self.nc, self.nk
        consts = [i for i in self.b_ins if i < nc]
        scanned = [i for i in self.b_ins if i >= nc]
        carried = [nc + i for i, c in enumerate(self.b_carry) if c]
        const_values = [_read(env, ins[i]) for i in consts]

        def step(carry: list, x: list) -> tuple:
            inner = self._inner(consts + scanned + carried, [*const_values, *x, *carry])
            _run(body.eqns, self.b_live, inner)
            out = [_read(inner, body.outvars[i - nc]) for i in carried]
            ys = [_read(inner, body.outvars[nk + j]) for j in self.b_ys]
            return out, ys + [inner[v] for v in self.exports]

        ys: list
        carry, ys = lax.scan(
            step,
            [_read(env, ins[i]) for i in carried],
            [_read(env, ins[i]) for i in scanned],
            length=self.length,
            reverse=self.reverse,
            unroll=self.unroll,
        )
        outs = self.eqn.outvars
        env.update(zip([outs[i - nc] for i in carried], carry))
        env.update(zip([outs[nk + j] for j in self.b_ys], ys))
        env.update(zip([(self, v) for v in self.exports], ys[len(self.b_ys) :]))

    def run_w(self, env: dict) -> None:
        ins, body, nc, nk = self.eqn.invars, self.body, self.nc, self.nk
        consts = [i for i in self.w_ins if i < nc]
        scanned = [i for i in self.w_ins if i >= nc]
        carried = [nc + i for i, c in enumerate(self.w_carry) if c]
        const_values = [_read(env, ins[i]) for i in consts]
        n = len(scanned)

        def step(carry: list, x: list) -> tuple:
            inner = self._inner(consts + scanned + carried, [*const_values, *x[:n], *carry])
            inner.update(zip(self.exports, x[n:]))
            _run(body.eqns, self.w_live, inner)
            out = [_read(inner, body.outvars[i - nc]) for i in carried]
            return out, [_read(inner, body.outvars[j]) for j in self.w_outs if j >= nk]

        xs = [_read(env, ins[i]) for i in scanned] + [env[(self, v)] for v in self.exports]
        ys: list
        carry, ys = lax.scan(
            step,
            [_read(env, ins[i]) for i in carried],
            xs,
            length=self.length,
            reverse=self.reverse,
            unroll=self.unroll,
        )
        outs = self.eqn.outvars
        env.update(zip([outs[i - nc] for i in carried], carry))
        env.update(zip([outs[j] for j in self.w_outs if j >= nk], ys))


class _Split:
    """A stage's backward cut into B and W: ``run_b(params, h, ct) -> (d_h, saved)`` recomputes
    the forward and computes the input's gradient, ``run_w(saved) -> d_params`` the params'.

    The vjp ``(params, h, ct) -> (d_params, d_h)`` is traced once as a jaxpr. B runs every
    equation the input's gradient needs; W every other equation the params' gradient needs,
    reading what B computed of it from ``saved``. A ``scan`` B needs part of (the layers'
    backward) is cut: B's scan carries the cotangent down the layers and exports each
    layer's values that W's scan reads. An equation B needs whole (a ``jit``, a
    ``checkpoint``) is not cut: B runs it, and W only reads its outputs. Every value is
    computed by the same equation as in the vjp, so the gradients are the vjp's.
    """

    def __init__(self, stage_fn: Any, own: PyTree, h: jax.Array) -> None:
        def vjp(params: PyTree, x: jax.Array, ct: jax.Array) -> tuple:
            return jax.vjp(stage_fn, params, x)[1](ct)

        closed = jax.make_jaxpr(vjp)(own, h, h)
        self.treedef = jax.tree_util.tree_structure(own)
        jaxpr = self.jaxpr = closed.jaxpr
        self.consts = closed.consts
        eqns = jaxpr.eqns
        # B: what the input's gradient (the last output) needs.
        needed = set(_atoms(jaxpr.outvars[-1:]))
        self.b_part: list = [None] * len(eqns)  # True: the whole equation; a _ScanCut: its B part
        for i in reversed(range(len(eqns))):
            eqn = eqns[i]
            need = [v in needed for v in eqn.outvars]
            if not any(need):
                continue
            if str(eqn.primitive) == _SCAN:
                self.b_part[i] = _ScanCut(eqn, need)
                needed.update(_atoms(self.b_part[i].b_reads()))
            else:
                self.b_part[i] = True
                needed.update(_atoms(eqn.invars))
        has = set(jaxpr.invars)
        for eqn, b in zip(eqns, self.b_part, strict=True):
            if b is True:
                has.update(eqn.outvars)
            elif b is not None:
                has.update(v for j, v in enumerate(eqn.outvars) if b.b_computes(j))
        # W: what the params' gradient needs that B does not compute.
        needed = set(_atoms(jaxpr.outvars[:-1]))
        self.w_part: list = [None] * len(eqns)
        for i in reversed(range(len(eqns))):
            eqn, b = eqns[i], self.b_part[i]
            wanted = [j for j, v in enumerate(eqn.outvars) if v in needed]
            if not wanted or b is True:
                continue
            if b is None:
                self.w_part[i] = True
                needed.update(_atoms(eqn.invars))
            else:
                needed.update(_atoms(b.plan_w(wanted)))
                self.w_part[i] = b if b.w_outs else None
        # Saved: what W reads of B's values, in the order B computes them.
        order = list(jaxpr.invars) + [v for eqn in eqns for v in eqn.outvars]
        self.saved: list = [v for v in order if v in needed and v in has]
        for b in self.b_part:
            if isinstance(b, _ScanCut):
                self.saved += [(b, v) for v in b.exports]

    def saved_types(self) -> list[tuple[tuple, Any, tuple]]:
        """Each saved value's ``(shape, dtype, axes)``."""
        out = []
        for key in self.saved:
            cut, v = key if isinstance(key, tuple) else (None, key)
            shape = v.aval.shape if cut is None else (cut.length, *v.aval.shape)
            axes = tuple(sorted(varying_of(v.aval) or (), key=str))
            out.append((shape, v.aval.dtype, axes))
        return out

    def run_b(self, own: PyTree, h: jax.Array, ct: jax.Array) -> tuple[jax.Array, list]:
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, [*jax.tree_util.tree_leaves(own), h, ct]))
        for eqn, b in zip(self.jaxpr.eqns, self.b_part, strict=True):
            if b is True:
                env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
            elif b is not None:
                b.run_b(env)
        return _read(env, self.jaxpr.outvars[-1]), [env[k] for k in self.saved]

    def run_w(self, saved: list) -> PyTree:
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.saved, saved))
        for eqn, w in zip(self.jaxpr.eqns, self.w_part, strict=True):
            if w is True:
                env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
            elif w is not None:
                w.run_w(env)
        leaves = [_read(env, v) for v in self.jaxpr.outvars[:-1]]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


# ------------------------------------------------------------------ the table, slot by slot


def zero_bubble(
    p: Staged, rows: list, keep: int, act: tuple
) -> tuple[jax.Array, PyTree, PyTree, jax.Array]:
    """Run the table ``rows`` (:meth:`ZeroBubble.table`), keeping stage inputs and output
    cotangents in ``keep`` buffers (:meth:`ZeroBubble.kept_inputs`: micro-batch i in buffer
    i mod ``keep``) and what B saves for W in :func:`kept_for_w` buffers. ``loss_fn`` is
    ``(head, out, y) -> mean loss``; ``act``: the axes the activations vary over. Returns
    what the other lowerings return: the last stage's mean loss (0 elsewhere), this stage's
    gradient summed over micro-batches of the mean loss, the head's gradient (the last
    stage's) and the inputs' (stage 0's)."""
    stage_fn, loss_fn, own, xs, ys, stage_axis, head = p.parts()
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    last = n_stages - 1
    m = xs.shape[0]
    kind_np, mb_np = tables(rows)
    kinds, mbs = jnp.asarray(kind_np), jnp.asarray(mb_np)
    zero = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), act)
    split = _Split(stage_fn, own, zero)
    wkeep = kept_for_w(rows)
    saved0 = [
        cast_varying(jnp.zeros((wkeep, *shape), dtype), axes)
        for shape, dtype, axes in split.saved_types()
    ]
    inputs0 = cast_varying(jnp.zeros((keep,) + xs.shape[1:], xs.dtype), act)
    zeros = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), axes_of(p)), own)
    head0 = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), axes_of(p)), head)
    leaves = jax.tree_util.tree_leaves((ys, head))
    loss0 = cast_varying(
        jnp.zeros((), jnp.float32), tuple(sorted(set(act).union(*map(axes_of, leaves)), key=str))
    )
    d_xs0 = cast_varying(jnp.zeros(xs.shape, xs.dtype), act)
    kept0 = [buf[0] for buf in saved0]
    template = (zero, zero, zero, kept0, zeros, head0, loss0)
    up = [(i, i + 1) for i in range(last)]
    down = [(i + 1, i) for i in range(last)]

    def typed(tree: PyTree) -> PyTree:
        return jax.tree_util.tree_map(lambda v, r: cast_varying(v, axes_of(r)), tree, template)

    def one_slot(carry, t):
        inputs, cts, saved, acc, acc_head, loss, d_xs = carry
        kind, k = kinds[s, t], mbs[s, t]
        i, w = k % keep, k % wkeep
        inp = cast_varying(jnp.where(s == 0, xs[k], inputs[i]), act)  # F's and B's
        ct, kept = cts[i], [buf[w] for buf in saved]
        # The switch returns slot-sized values and the accumulators; the buffers are updated
        # in place after it (passed through a branch, XLA copies a buffer whole).

        def idle():
            return typed((zero, zero, ct, kept, acc, acc_head, loss))

        def forward():
            return typed((stage_fn(own, inp), zero, ct, kept, acc, acc_head, loss))

        def forward_head():  # the last stage's: the head, its loss and B's cotangent
            out = stage_fn(own, inp)
            y = jax.tree_util.tree_map(lambda v: v[k], ys)
            value, (d_head, d_out) = jax.value_and_grad(loss_fn, argnums=(0, 1))(head, out, y)
            acc_head_new = jax.tree_util.tree_map(lambda a, d: a + d / m, acc_head, d_head)
            loss_new = loss + value.astype(jnp.float32)
            return typed((out, zero, d_out / m, kept, acc, acc_head_new, loss_new))

        def backward():  # B: the input's gradient, which the stage below waits for
            d_input, kept_new = split.run_b(own, inp, ct)
            return typed((zero, d_input, ct, kept_new, acc, acc_head, loss))

        def weight():  # W: the params' gradient, which nobody waits for
            acc_new = jax.tree_util.tree_map(jnp.add, acc, split.run_w(kept))
            return typed((zero, zero, ct, kept, acc_new, acc_head, loss))

        branch = jnp.where((kind == FORWARD) & (s == last), HEAD, kind)
        out, d_input, ct, kept, acc, acc_head, loss = lax.switch(
            branch, (idle, forward, backward, weight, forward_head)
        )
        cts = cts.at[i].set(ct)
        saved = [buf.at[w].set(v) for buf, v in zip(saved, kept, strict=True)]
        d_xs = d_xs.at[k].set(jnp.where((s == 0) & (kind == BACKWARD), d_input, d_xs[k]))
        # -> every forward's output one stage up, <- every B's input gradient one stage down
        got_up = primitives.sendrecv(out, stage_axis, up)
        got_down = primitives.sendrecv(d_input, stage_axis, down)
        below, above = jnp.maximum(s - 1, 0), jnp.minimum(s + 1, last)
        from_below = (s > 0) & (kinds[below, t] == FORWARD)
        from_above = (s < last) & (kinds[above, t] == BACKWARD)
        i, j = mbs[below, t] % keep, mbs[above, t] % keep
        inputs = inputs.at[i].set(jnp.where(from_below, got_up, inputs[i]))
        cts = cts.at[j].set(jnp.where(from_above, got_down, cts[j]))
        return (inputs, cts, saved, acc, acc_head, loss, d_xs), None

    carry = (inputs0, inputs0, saved0, zeros, head0, loss0, d_xs0)
    (_, _, _, grads, d_head, loss, d_xs), _ = lax.scan(
        one_slot, carry, jnp.arange(kind_np.shape[1])
    )
    return loss / m, grads, d_head, d_xs
