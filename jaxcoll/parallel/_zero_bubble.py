"""The lowering of :class:`~jaxcoll.parallel.ZeroBubble` (ZB-H1): a table of F, B and W slots.

The schedule's :meth:`~jaxcoll.parallel.ZeroBubble.table` is computed on the host and baked
into the program as small int arrays (stage x slot). One ``lax.scan`` runs its slots; in each,
every stage runs its own entry: a forward (the last stage's with the head, a branch of its own
so that the other stages skip the head's FLOPs), B or W (:mod:`._backward_split`), each a
``lax.cond`` of its own that touches only what it changes (the accumulated gradient is passed
through a W-less slot, not copied; B writes what W needs into W's buffers in place), then
one ``sendrecv``.

One per slot: :func:`transfers` plans every message (a forward's output one stage up, a B's
input gradient one stage down) so that a stage sends at most one and receives at most one a
slot, a B's gradient waiting a slot in a one-message outbox where the stage below receives a
forward's output that slot; every message still arrives in time for the table (checked for
2-8 stages and 1-24 micro-batches by the tests). Which stages send where differs from slot to
slot; the slot's pattern (a handful per table) picks one ``sendrecv`` of a ``lax.switch``
whose index is the same on every stage. On XLA:CPU each collective is a rendezvous of every
device's thread, and one a slot instead of two took the step from 1.5x to about 1x 1F1B's
time (benchmarks/pipeline_schedules.py).

What arrives is kept by micro-batch until the stage's B (stage inputs, output cotangents),
what B saves for W until its W (:func:`kept_for_w` buffers).
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
from ._backward_split import _Split
from ._lowering import Staged, add_aux, aux_zeros, axes_of, side_at
from ._stages import MicroBatches, _at, _put, _targets_at

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
_KINDS = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}
#: What a stage sends in a slot (:func:`transfers`).
NOTHING, OUT, GRAD, HELD = 0, 1, 2, 3
#: What a stage receives in a slot.
STAGE_INPUT, COTANGENT = 1, 2


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


def transfers(rows: list) -> dict[str, Any]:
    """Every message of the table ``rows``, one out of and one into a stage a slot: in slot t
    stage s sends ``send[s, t]`` (NOTHING, OUT: this slot's forward output, one stage up;
    GRAD: this slot's B gradient, one stage down; HELD: the one its outbox kept from the slot
    before, down) and puts this slot's B gradient in its outbox when ``hold[s, t]``; it
    receives ``recv[s, t]`` (STAGE_INPUT or COTANGENT) of micro-batch ``recv_mb[s, t]``; the
    slot's sendrecv pairs are ``patterns[pattern[t]]``. A forward's output is sent in its
    slot, a B's gradient in its slot or the next (to a stage receiving a forward's output in
    the first), in time for the table (which assumes one slot's latency): a table where that
    fails is refused."""
    stages, slots = len(rows), len(rows[0])
    out = {k: np.zeros((stages, slots), np.int32) for k in ("send", "hold", "recv", "recv_mb")}
    pattern, patterns = np.zeros(slots, np.int32), []
    held: list[Any] = [None] * stages
    for t in range(slots):
        fresh: list[Any] = [None] * stages  # (direction, micro-batch) made this slot
        for s in range(stages):
            op = rows[s][t]
            if op is not None and op[0] == "F" and s < stages - 1:
                fresh[s] = ("up", op[1])
            if op is not None and op[0] == "B" and s > 0:
                fresh[s] = ("down", op[1])
        taken: set[int] = set()
        pairs: list[tuple[int, int]] = []
        for s in range(stages):  # a held gradient first, then what this slot made
            for kept in (True, False):
                message = held[s] if kept else fresh[s]
                if message is None:
                    continue
                way, k = message
                dst = s + 1 if way == "up" else s - 1
                if dst in taken:
                    continue
                taken.add(dst)
                pairs.append((s, dst))
                out["send"][s, t] = HELD if kept else OUT if way == "up" else GRAD
                out["recv"][dst, t] = STAGE_INPUT if way == "up" else COTANGENT
                out["recv_mb"][dst, t] = k
                if kept:
                    held[s] = None
                else:
                    fresh[s] = None
                break
        for s in range(stages):
            if fresh[s] is not None:
                if fresh[s][0] == "up" or held[s] is not None:
                    raise AssertionError(f"ZB-H1: no slot for stage {s}'s message at slot {t}")
                held[s], out["hold"][s, t] = fresh[s], 1
        if tuple(pairs) not in patterns:
            patterns.append(tuple(pairs))
        pattern[t] = patterns.index(tuple(pairs))
    when = {(s, op): t for s, row in enumerate(rows) for t, op in enumerate(row) if op}
    for s, t in zip(*np.nonzero(out["recv"])):
        needs = "F" if out["recv"][s, t] == STAGE_INPUT else "B"
        if when[(int(s), (needs, int(out["recv_mb"][s, t])))] <= t or any(held):
            raise AssertionError(f"ZB-H1: stage {s}'s {needs} runs before its input arrives")
    return {**out, "pattern": pattern, "patterns": patterns}


# ------------------------------------------------------------------ the table, slot by slot


def _typed(tree: PyTree, like: PyTree) -> PyTree:
    """``tree`` typed as ``like`` (every branch of a cond alike)."""
    return jax.tree_util.tree_map(lambda v, r: cast_varying(v, axes_of(r)), tree, like)


def _first_carry(
    p: Staged, split: _Split, zero: jax.Array, act: tuple, keep: int, wkeep: int
) -> tuple:
    """The slots' first carry, ``(stage inputs, output cotangents, what B saves for W,
    gradient, head's gradient, loss, inputs' gradient, outbox, (loss terms, aux))``, each
    zero and typed as what it will hold."""
    _, _, own, xs, ys, _, head = p.parts()
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
    d_xs0 = cast_varying(jnp.zeros(xs.stack.shape, xs.dtype), act)  # laid out as xs
    return (inputs0, inputs0, saved0, zeros, head0, loss0, d_xs0, zero, aux_zeros(p, act))


def _forward_ops(p: Staged, f_like: tuple, k: jax.Array) -> tuple:
    """A slot's forward of micro-batch ``k`` as the branches of a ``lax.switch``: none, a
    forward, and the last stage's forward with the head. Each maps ``(inp, acc_head, loss,
    extra)`` to ``(out, d_out, acc_head, loss, extra)`` (``extra``: the stage's loss terms and
    aux, :func:`aux_zeros`), typed as ``f_like``; each passes through what it does not
    change."""
    _, loss_fn, own, xs, ys, _, head = p.parts()
    m = xs.shape[0]
    zero = f_like[0]

    def no_forward(inp: jax.Array, acc_head: PyTree, loss: jax.Array, extra: tuple) -> tuple:
        return _typed((zero, zero, acc_head, loss, extra), f_like)

    def forward(inp: jax.Array, acc_head: PyTree, loss: jax.Array, extra: tuple) -> tuple:
        out, term, aux = p.forward(own, inp, k)
        return _typed((out, zero, acc_head, loss, add_aux(extra, term, aux, k)), f_like)

    def forward_head(inp: jax.Array, acc_head: PyTree, loss: jax.Array, extra: tuple) -> tuple:
        """The last stage's forward: the head, its loss and B's cotangent too."""
        out, term, aux = p.forward(own, inp, k)
        y = _targets_at(ys, k)
        value, (d_head, d_out) = jax.value_and_grad(loss_fn, argnums=(0, 1))(head, out, y)
        acc_head = jax.tree_util.tree_map(lambda a, d: a + d / m, acc_head, d_head)
        loss = loss + value.astype(jnp.float32)
        return _typed((out, d_out / m, acc_head, loss, add_aux(extra, term, aux, k)), f_like)

    return no_forward, forward, forward_head


def _split_ops(split: _Split, own: PyTree, carry0: tuple, w: jax.Array, side: PyTree) -> tuple:
    """B's and W's conds' branches ``((B, none), (W, none))``, each over only what it changes
    (passed through, not copied, in the slots it does not run); ``w``: the micro-batch's entry
    of W's buffers; ``side``: its side inputs (None: none). ``carry0``: the slots' first carry
    (the types)."""
    _, _, saved0, zeros, _, _, _, zero, _ = carry0

    def backward(inp: jax.Array, ct: jax.Array, saved: list) -> tuple:
        """B: the input's gradient, which the stage below waits for; what W will need
        written into W's buffers at ``w``."""
        return _typed(split.run_b(own, inp, ct, into=(saved, w), side=side), (zero, saved0))

    def no_backward(inp: jax.Array, ct: jax.Array, saved: list) -> tuple:
        return _typed((zero, saved), (zero, saved0))

    def weight(acc: PyTree, saved: list) -> PyTree:
        """W: the params' gradient, which nobody waits for."""
        return _typed(jax.tree_util.tree_map(jnp.add, acc, split.run_w(saved, w)), zeros)

    def no_weight(acc: PyTree, saved: list) -> PyTree:
        return _typed(acc, zeros)

    return (backward, no_backward), (weight, no_weight)


def zero_bubble(
    p: Staged, rows: list, keep: int, act: tuple
) -> tuple[jax.Array, PyTree, PyTree, jax.Array, tuple]:
    """Run the table ``rows`` (:meth:`ZeroBubble.table`), keeping stage inputs and output
    cotangents in ``keep`` buffers (:meth:`ZeroBubble.kept_inputs`: micro-batch i in buffer
    i mod ``keep``) and what B saves for W in :func:`kept_for_w` buffers. ``loss_fn`` is
    ``(head, out, y) -> mean loss``; ``act``: the axes the activations vary over. Returns
    what the other lowerings return: the last stage's mean loss (0 elsewhere), this stage's
    gradient summed over micro-batches of the mean loss, the head's gradient (the last
    stage's) and the inputs' (stage 0's)."""
    stage_fn, _, own, xs, _, stage_axis, _ = p.parts()
    s = primitives.rank(stage_axis)
    # The side inputs typed as a slot reads them (varying over the stage axis: a slot's
    # micro-batch is the stage's own), so B replays the split's jaxpr on the types it was
    # traced with.
    sides = jax.tree_util.tree_map(
        lambda v: MicroBatches(
            cast_varying(v.stack, tuple(sorted({*axes_of(v.stack), stage_axis}, key=str))), v.axis
        ),
        p.sides,
    )
    last = primitives.world_size(stage_axis) - 1
    m = xs.shape[0]
    kind_np, mb_np = tables(rows)
    plan = transfers(rows)
    kinds, mbs = jnp.asarray(kind_np), jnp.asarray(mb_np)
    send, hold, recv, recv_mb, pattern = (
        jnp.asarray(plan[k]) for k in ("send", "hold", "recv", "recv_mb", "pattern")
    )
    zero = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), act)
    term = None
    if p.has_aux:  # the loss term's axes and M: its cotangent in B and W
        term = (axes_of(aux_zeros(p, act)[0]), m)
    split = _Split(stage_fn, own, zero, side_at(sides, 0), term)
    wkeep = kept_for_w(rows)
    carry0 = _first_carry(p, split, zero, act, keep, wkeep)
    # (out, d_out, head's gradient, loss, (loss terms, aux))
    f_like = (zero, zero, carry0[4], carry0[5], carry0[8])

    def mover(pairs: tuple) -> Any:
        return lambda x: primitives.sendrecv(x, stage_axis, list(pairs)) if pairs else x

    movers = [mover(pairs) for pairs in plan["patterns"]]

    def one_slot(carry: tuple, t: jax.Array) -> tuple:
        inputs, cts, saved, acc, acc_head, loss, d_xs, outbox, extra = carry
        kind, k = kinds[s, t], mbs[s, t]
        i, w = k % keep, k % wkeep
        inp = cast_varying(jnp.where(s == 0, xs[k], inputs[i]), act)  # F's and B's

        # Each operation a cond of its own over what it changes (passed through, not copied,
        # in the slots it does not run).
        head_now = (kind == FORWARD) & (s == last)
        which = jnp.where(kind == FORWARD, jnp.where(s == last, 2, 1), 0)
        out, d_out, acc_head, loss, extra = lax.switch(
            which, _forward_ops(p, f_like, k), inp, acc_head, loss, extra
        )
        (backward, no_backward), (weight, no_weight) = _split_ops(
            split, own, carry0, w, side_at(sides, k)
        )
        d_input, saved = lax.cond(kind == BACKWARD, backward, no_backward, inp, cts[i], saved)
        acc = lax.cond(kind == WEIGHT, weight, no_weight, acc, saved)
        d_xs = _put(d_xs, k, jnp.where((s == 0) & (kind == BACKWARD), d_input, _at(d_xs, k)))
        # One sendrecv: this slot's forward output up, or a B's gradient (this slot's or the
        # outbox's) down; the slot's pattern is the same on every stage.
        what = send[s, t]
        message = jnp.where(what == OUT, out, jnp.where(what == GRAD, d_input, outbox))
        outbox = jnp.where(hold[s, t] == 1, d_input, outbox)
        got = lax.switch(pattern[t], movers, message)
        j = recv_mb[s, t] % keep
        inputs = inputs.at[j].set(jnp.where(recv[s, t] == STAGE_INPUT, got, inputs[j]))
        # One write a slot into the cotangents: the head's (the last stage, which receives
        # none) or the one received.
        c = jnp.where(head_now, i, j)
        ct = jnp.where(recv[s, t] == COTANGENT, got, cts[c])
        cts = cts.at[c].set(jnp.where(head_now, d_out, ct))
        return (inputs, cts, saved, acc, acc_head, loss, d_xs, outbox, extra), None

    (_, _, _, grads, d_head, loss, d_xs, _, extra), _ = lax.scan(
        one_slot, carry0, jnp.arange(kind_np.shape[1])
    )
    return loss / m, grads, d_head, d_xs, extra
