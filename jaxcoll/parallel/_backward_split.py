"""A stage's backward cut in two for :class:`~jaxcoll.parallel.ZeroBubble`: B, the input's
gradient (the stage below waits for it), and W, the params' gradient (nobody waits for it).

The stage's vjp is traced once as a jaxpr and cut, equation by equation (a ``scan`` over
layers cut into two scans), into what the input's gradient needs, which B runs after
recomputing the forward from the kept stage input, and the rest, the params' gradient, which
W runs from what B saved for it (each layer's inputs and output cotangents: those of the
weight-gradient matmuls). So a micro-batch costs a stage one forward, one recomputed forward
and one backward, as 1F1B's does; W recomputes nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._core.typing import PyTree
from .._core.vma import cast_varying
from .._jax import Literal, jaxpr_parts, scan_counts, varying_of
from ._lowering import call_stage

_SCAN = "scan"


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


class _Slot:
    """Micro-batch ``w``'s entry of one of B's buffers: what B wrote there for W, read where
    it is used (a scan's iteration reads its own layer's part, with no copy of the whole)."""

    def __init__(self, buf: jax.Array, w: jax.Array) -> None:
        self.buf, self.w = buf, w


def _raw(env: dict, v: Any) -> Any:
    """``v``'s value, a :class:`_Slot` left as it is."""
    return v.val if isinstance(v, Literal) else env[v]


def _read(env: dict, v: Any) -> Any:
    x = _raw(env, v)
    return x.buf[x.w] if isinstance(x, _Slot) else x


def _scanned(values: list) -> tuple[list, Any]:
    """A scan's inputs, some :class:`_Slot`: ``(arrays, at)``, the arrays to scan over and
    ``at(i, x)``, iteration ``i``'s values from the arrays' ``x`` (a slot's part read)."""
    arrays = [v for v in values if not isinstance(v, _Slot)]

    def at(i: jax.Array, x: list) -> list:
        it = iter(x)
        return [v.buf[v.w, i] if isinstance(v, _Slot) else next(it) for v in values]

    return arrays, at


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

    def run_b(self, env: dict, into: tuple[dict, jax.Array]) -> None:
        """B's part; ``into``: ``({saved: buffer}, w)``, each iteration's values that W reads
        (exports, stacked outputs) written into their buffers at ``[w, iteration]`` in place."""
        ins, body, nc, nk = self.eqn.invars, self.body, self.nc, self.nk
        outs = self.eqn.outvars
        consts = [i for i in self.b_ins if i < nc]
        scanned = [i for i in self.b_ins if i >= nc]
        carried = [nc + i for i, c in enumerate(self.b_carry) if c]
        const_values = [_read(env, ins[i]) for i in consts]
        sink, w = into
        kept = [j for j in self.b_ys if outs[nk + j] in sink]  # outputs written for W
        stacked = [j for j in self.b_ys if j not in kept]
        bufs = [sink[(self, v)] for v in self.exports] + [sink[outs[nk + j]] for j in kept]
        nb = len(bufs)
        arrays, at = _scanned([_raw(env, ins[i]) for i in scanned])

        def step(carry: list, x: list) -> tuple:
            values = [*const_values, *at(x[0], x[1:]), *carry[nb:]]
            inner = self._inner(consts + scanned + carried, values)
            _run(body.eqns, self.b_live, inner)
            out = [_read(inner, body.outvars[i - nc]) for i in carried]
            ys = [_read(inner, body.outvars[nk + j]) for j in stacked]
            new = [inner[v] for v in self.exports] + [
                _read(inner, body.outvars[nk + j]) for j in kept
            ]
            return [b.at[w, x[0]].set(v) for b, v in zip(carry[:nb], new)] + out, ys

        ys: list
        carry, ys = lax.scan(
            step,
            bufs + [_read(env, ins[i]) for i in carried],
            [jnp.arange(self.length), *arrays],
            length=self.length,
            reverse=self.reverse,
            unroll=self.unroll,
        )
        env.update(zip([outs[i - nc] for i in carried], carry[nb:]))
        env.update(zip([outs[nk + j] for j in stacked], ys))
        env.update(zip([(self, v) for v in self.exports], carry[: len(self.exports)]))
        env.update(
            zip([outs[nk + j] for j in kept], [_Slot(b, w) for b in carry[len(self.exports) :]])
        )

    def run_w(self, env: dict, w: jax.Array) -> None:
        """W's part: the exports are whole buffers, read at ``[w, iteration]``."""
        ins, body, nc, nk = self.eqn.invars, self.body, self.nc, self.nk
        consts = [i for i in self.w_ins if i < nc]
        scanned = [i for i in self.w_ins if i >= nc]
        carried = [nc + i for i, c in enumerate(self.w_carry) if c]
        const_values = [_read(env, ins[i]) for i in consts]
        exported = [_Slot(env[(self, v)], w) for v in self.exports]
        arrays, at = _scanned([_raw(env, ins[i]) for i in scanned] + exported)

        def step(carry: list, x: list) -> tuple:
            got = at(x[0], x[1:])
            inner = self._inner(consts + scanned + carried, [*const_values, *got, *carry])
            inner.update(zip(self.exports, got[len(scanned) :]))
            _run(body.eqns, self.w_live, inner)
            out = [_read(inner, body.outvars[i - nc]) for i in carried]
            return out, [_read(inner, body.outvars[j]) for j in self.w_outs if j >= nk]

        ys: list
        carry, ys = lax.scan(
            step,
            [_read(env, ins[i]) for i in carried],
            [jnp.arange(self.length), *arrays],
            length=self.length,
            reverse=self.reverse,
            unroll=self.unroll,
        )
        outs = self.eqn.outvars
        env.update(zip([outs[i - nc] for i in carried], carry))
        env.update(zip([outs[j] for j in self.w_outs if j >= nk], ys))


class _Split:
    """A stage's backward cut into B and W: ``run_b(params, h, ct, side) -> (d_h, saved)``
    recomputes the forward and computes the input's gradient, ``run_w(saved) -> d_params`` the
    params'.

    The vjp ``(params, h, side, ct) -> (d_params, d_h)`` is traced once as a jaxpr (``side``:
    the micro-batch's side inputs, or None; never differentiated: what W reads of them, B
    saves for it, as any value of the forward). B runs every
    equation the input's gradient needs; W every other equation the params' gradient needs,
    reading what B computed of it from ``saved``. A ``scan`` B needs part of (the layers'
    backward) is cut: B's scan carries the cotangent down the layers and exports each
    layer's values that W's scan reads. An equation B needs whole (a ``jit``, a
    ``checkpoint``) is not cut: B runs it, and W only reads its outputs. Every value is
    computed by the same equation as in the vjp, so the gradients are the vjp's.
    """

    def __init__(
        self,
        stage_fn: Any,
        own: PyTree,
        h: jax.Array,
        side: PyTree = None,
        term: tuple[tuple, int] | None = None,
    ) -> None:
        # ``term``: where ``stage_fn`` returns ``(h, (loss_term, aux))``, ``(axes, M)``: the
        # loss term, typed varying over ``axes``, gets the cotangent 1 / M in B and W alike.
        def vjp(params: PyTree, x: jax.Array, side: PyTree, ct: jax.Array) -> tuple:
            def forward(params: PyTree, x: jax.Array) -> Any:
                out = call_stage(stage_fn, params, x, side)
                if term is None:
                    return out
                h, (loss_term, _) = out
                return h, cast_varying(loss_term.astype(jnp.float32), term[0])

            if term is None:
                return jax.vjp(forward, params, x)[1](ct)
            scale = cast_varying(jnp.full((), 1.0 / term[1], jnp.float32), term[0])
            return jax.vjp(forward, params, x)[1]((ct, scale))

        closed = jax.make_jaxpr(vjp)(own, h, side, h)
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

    def run_b(
        self,
        own: PyTree,
        h: jax.Array,
        ct: jax.Array,
        into: tuple[list, jax.Array],
        side: PyTree = None,
    ) -> tuple[jax.Array, list]:
        """``(d_h, buffers)``: the input's gradient, and ``into = (buffers, w)`` (one per
        :meth:`saved_types`, micro-batch first) with what W needs written at ``w``, in place;
        ``side``: the micro-batch's side inputs (typed as those the split was made with)."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        leaves = jax.tree_util.tree_leaves
        env.update(zip(self.jaxpr.invars, [*leaves(own), h, *leaves(side), ct], strict=True))
        buffers, w = into
        sink = (dict(zip(self.saved, buffers)), w)
        for eqn, b in zip(self.jaxpr.eqns, self.b_part, strict=True):
            if b is True:
                env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
            elif b is not None:
                b.run_b(env, sink)
        d_h = _read(env, self.jaxpr.outvars[-1])
        return d_h, [
            env[k]
            if isinstance(k, tuple)
            else env[k].buf
            if isinstance(env[k], _Slot)
            else buf.at[w].set(env[k])
            for k, buf in zip(self.saved, buffers, strict=True)
        ]

    def run_w(self, buffers: list, w: jax.Array) -> PyTree:
        """The params' gradient from what B wrote into ``buffers`` at micro-batch ``w`` (a
        scan's entries read layer by layer inside W's scan)."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(
            (k, v if isinstance(k, tuple) else _Slot(v, w))
            for k, v in zip(self.saved, buffers, strict=True)
        )
        for eqn, part in zip(self.jaxpr.eqns, self.w_part, strict=True):
            if part is True:
                env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
            elif part is not None:
                part.run_w(env, w)
        leaves = [_read(env, v) for v in self.jaxpr.outvars[:-1]]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)
