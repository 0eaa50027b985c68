"""The interleaved 1F1B schedule (Megatron's virtual pipeline stages) of
:func:`jaxcoll.parallel.pipeline_value_and_grad`: its argument checks, its index formulas
(plain arithmetic, so the lowering runs them on traced ints and the tests count the
schedule's slots with them on the host) and its lowering.

Stage s of S holds v model chunks, chunk c being model chunk ``c*S + s``: a micro-batch goes
round the ring of stages v times, from the last stage back to stage 0 between chunks. Each
stage runs its forwards in one fixed order and its backwards in another (:func:`item`), in
rounds of two slots (:func:`round_items`): a forward slot, after which one ``sendrecv`` moves
every activation to the next stage, then a backward slot, after which one ``sendrecv``
moves every cotangent to the previous stage (both around the ring).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import primitives
from .._core.typing import PyTree
from .._core.vma import cast_varying
from ._lowering import Staged, axes_of
from ._stages import _at, _put, _targets_at


def _reshape_hint(v: int, name: str) -> str:
    """How layers stacked ``(L, ...)`` become ``(v, L // v, ...)``: the line to write."""
    return (
        f"Layers stacked (L, ...) in the model's order need the reshape to (v, L // v, ...) "
        f"once, before they are placed, and their spec moved to the second dim: write "
        f"`blocks = jax.tree.map(lambda t: t.reshape(({v}, t.shape[0] // {v}) + t.shape[1:]), "
        f"blocks)` and give them P(None, {name!r}, ...) (nn.Partitioned names (None, "
        f"{name!r}, ...)) instead of P({name!r}, ...): stage s then holds chunks s, s + S, ..."
    )


def _expected(shape: tuple, v: int, n: int | None) -> str:
    """The shape a leaf of ``shape`` would have stacked ``(v, n, ...)``, as text."""
    if n is None and shape and shape[0] % v == 0:
        n = shape[0] // v
    rest = ", ".join(str(d) for d in ((n,) + tuple(shape[1:]))) if n is not None else "n, ..."
    return f"({v}, {rest})"


def check_chunks(api: str, params: PyTree, v: int, *, stages: int | None = None) -> None:
    """Interleaved params: every leaf stacks this stage's v chunks on a leading axis, else a
    ValueError naming the reshape (``stages``: the stage axis's size, for the message)."""
    where = "" if stages is None else f" here (this stage's part, of {stages} stages)"
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        shape = tuple(jnp.shape(leaf))
        if not shape or shape[0] != v:
            guess = (
                f" (e.g. {_expected(shape, v, None)} if its {shape[0]} leading entries are layers)"
                if shape and shape[0] % v == 0
                else ""
            )
            raise ValueError(
                f"{api}: params{jax.tree_util.keystr(path)} has shape {shape}{where}, but "
                f"Interleaved(virtual={v}) needs a leading axis of {v} on every leaf, this "
                f"stage's {v} chunks (chunk c being model chunk c*S + s): expected ({v}, ...)"
                f"{guess}. " + _reshape_hint(v, "layers")
            )


def _leaves(params: PyTree) -> list:
    return jax.tree_util.tree_flatten_with_path(params)[0]


def _refusal(api: str, params: PyTree, v: int, stages: int | None, why: str) -> ValueError:
    """The error for interleaved params that are not ``(v, n, ...)``: what was given, what
    was expected and the reshape to write (``why``: what went wrong, a clause)."""
    flat = [(jax.tree_util.keystr(p), tuple(jnp.shape(x))) for p, x in _leaves(params)]
    where = "" if stages is None else f" here (this stage's part, of {stages} stages)"
    shown = ", ".join(f"params{k}: {shape}" for k, shape in flat)
    key, shape = flat[0]
    return ValueError(
        f"{api}: Interleaved(virtual={v}) reads every leaf of stage_params as this stage's "
        f"{v} chunks stacked ({v}, n, ...), n layers a chunk, one n for every leaf; got "
        f"{shown}{where}, and {why}. If these are layers, expected e.g. params{key} of shape "
        f"{_expected(shape, v, None)}. " + _reshape_hint(v, "layers")
    )


def check_layers(api: str, params: PyTree, v: int, stages: int | None) -> None:
    """Interleaved params of :func:`~jaxcoll.parallel.pipeline_loss`: every leaf ``(v, n,
    ...)``, this stage's v chunks of n layers each, n the same for every leaf (dense mode reads
    the two leading axes back as the model's layers in order). Else a ValueError naming the
    reshape: layers passed ``(L, ...)`` would otherwise fail deep in ``lax.scan`` ("scan got
    values with different leading axis sizes") or run in another order. ``stages``: the stage
    axis's size (None: dense mode)."""
    check_chunks(api, params, v, stages=stages)
    seconds = {jnp.shape(x)[1] if jnp.ndim(x) > 1 else None for _, x in _leaves(params)}
    if len(seconds) > 1 or None in seconds:
        why = "their second dims are no such n (layers stacked (L, ...) without the reshape?)"
        raise _refusal(api, params, v, stages, why)


def check_runs(
    api: str, run: Callable[[], Any], params: PyTree, v: int, stages: int | None
) -> None:
    """``run()``, a probe of ``stage_fn`` on one chunk of interleaved ``params`` (dense mode:
    on the layers read back in order); where it raises (a stage that cannot take the chunk,
    or changes the activation's shape), a ValueError naming the reshape, the stage's own
    error chained: layers stacked ``(L, ...)`` with L / S = v pass :func:`check_layers` when
    their leaves' second dims agree, then fail inside ``stage_fn``."""
    try:
        run()
    except (TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = f"stage_fn fails on one chunk ({type(e).__name__}: {first})"
        raise _refusal(api, params, v, stages, why) from e


def item(n: Any, num_stages: int, v: int, *, backward: bool) -> tuple[Any, Any]:
    """Entry ``n`` of a stage's forward (or backward) order as ``(micro-batch, chunk)``.

    Micro-batches go in groups of S: group g runs chunk 0 of micro-batches gS..gS+S-1, then
    chunk 1 of the same ones, ... up to chunk v - 1 (forward), or from chunk v - 1 down to
    chunk 0 (backward). Works on Python ints and on traced int arrays alike.
    """
    group, r = n // (num_stages * v), n % (num_stages * v)
    chunk = r // num_stages
    return group * num_stages + r % num_stages, (v - 1 - chunk) if backward else chunk


def position(i: Any, chunk: Any, num_stages: int, v: int) -> Any:
    """The forward order's entry of micro-batch ``i``'s ``chunk``: :func:`item`'s inverse."""
    return (i // num_stages) * num_stages * v + chunk * num_stages + i % num_stages


def round_items(k: Any, s: Any, num_stages: int, v: int) -> tuple[Any, Any]:
    """In round k stage s runs entry ``k - s`` of its forward order and entry
    ``k - (v + 1)S + 2 + s`` of its backward order (each where it is in ``0..Mv-1``).

    The forward of (micro-batch i, chunk c) on stage s feeds the same chunk on stage s + 1 in
    the next round, and chunk c + 1 on stage 0 in the next round when s = S - 1 (the order
    puts them S entries apart); backwards run the same way down. The last stage runs the
    backward of the model's last chunk in the round of its forward.
    """
    return k - s, k - (v + 1) * num_stages + 2 + s


def rounds(num_stages: int, v: int, m: int) -> int:
    """Rounds until stage 0's last backward: ``Mv + (v + 1)S - 2``."""
    return m * v + (v + 1) * num_stages - 2


def buffers(num_stages: int, v: int, m: int) -> int:
    """Stage inputs a stage keeps at once: ``min(Mv, vS + S - 1)`` (stage 0's peak)."""
    return min(m * v, (v + 1) * num_stages - 1)


def _chunk(params: PyTree, c: jax.Array | int) -> PyTree:
    return jax.tree_util.tree_map(lambda p: p[c], params)


def _typed(tree: PyTree, template: PyTree) -> PyTree:
    """A cond branch's outputs typed as ``template`` (both branches alike)."""
    return jax.tree_util.tree_map(lambda t, r: cast_varying(t, axes_of(r)), tree, template)


def _first_carry(p: Staged, v: int, act: tuple) -> tuple[tuple, PyTree]:
    """The rounds' first carry, ``(activation in, cotangent in, saved inputs, their holders,
    gradient, loss, head's gradient, inputs' gradient)``, each zero and typed as what it will
    hold (activations over ``act``, gradients as their params, the loss over the
    activations', targets' and head's axes), and a zero gradient of one chunk."""
    _, _, own, xs, ys, stage_axis, head = p.parts()
    keep = buffers(primitives.world_size(stage_axis), v, xs.shape[0])
    zero = cast_varying(jnp.zeros(xs.shape[1:], xs.dtype), act)
    saved0 = cast_varying(jnp.zeros((keep,) + xs.shape[1:], xs.dtype), act)
    holder0 = cast_varying(jnp.full((keep,), -1, jnp.int32), act)
    grads0 = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), axes_of(p)), own)
    chunk_zeros = _chunk(grads0, 0)
    head0 = jax.tree_util.tree_map(lambda p: cast_varying(jnp.zeros_like(p), axes_of(p)), head)
    leaves = jax.tree_util.tree_leaves((ys, head))
    loss_axes = set(act).union(*(axes_of(t) for t in leaves))
    loss0 = cast_varying(jnp.zeros((), jnp.float32), tuple(sorted(loss_axes, key=str)))
    d_xs0 = cast_varying(jnp.zeros(xs.stack.shape, xs.dtype), act)  # laid out as xs
    return (zero, zero, saved0, holder0, grads0, loss0, head0, d_xs0), chunk_zeros


def _forward_branches(
    p: Staged, v: int, like: tuple, s: jax.Array, fi: jax.Array, fc: jax.Array, act_in: jax.Array
) -> tuple:
    """A round's forward half, as the branches of a ``lax.switch``: nothing, a forward, or a
    forward of the model's last chunk with the head's (the other stages and chunks skip its
    FLOPs). Each gives ``(out, input, d_out, loss, d_head)``, typed as ``like``."""
    stage_fn, loss_fn, own, xs, ys, _, head = p.parts()
    m = xs.shape[0]
    zero, _, _, loss0, head0 = like

    def run_forward(with_head: bool):
        def branch():
            inp = jnp.where((s == 0) & (fc == 0), xs[fi], act_in)
            out = p.stage(_chunk(own, fc), inp, fi)
            if not with_head:
                return _typed((out, inp, zero, loss0, head0), like)
            y = _targets_at(ys, fi)
            value, (d_head, d_out) = jax.value_and_grad(loss_fn, argnums=(0, 1))(head, out, y)
            d_head = jax.tree_util.tree_map(lambda d: d / m, d_head)
            return _typed((out, inp, d_out / m, value.astype(jnp.float32), d_head), like)

        return branch

    return (lambda: like, run_forward(False), run_forward(True))


def interleaved(p: Staged, v: int, act: tuple) -> tuple[jax.Array, PyTree, PyTree, jax.Array]:
    """The lowering: one ``lax.scan`` over :func:`rounds`; each round a ``lax.cond`` runs this
    stage's forward (or nothing), one ``sendrecv`` shifts activations one stage up the ring,
    a second ``lax.cond`` runs its backward (or nothing) and one ``sendrecv`` shifts
    cotangents one stage down. Stage inputs wait in :func:`buffers` slots, each holding the
    forward entry it keeps (-1: free); a forward takes the first free one, its backward
    frees it. ``own`` has a leading axis of v (this stage's chunks).
    ``loss_fn`` is ``(head, out, y) -> mean loss``; ``act``: the axes the activations vary
    over (each value is typed as what it holds: activations over ``act``, gradients as their
    params, the loss over the activations', targets' and head's axes).
    Returns the last stage's mean loss (0 elsewhere), this stage's gradient, summed over
    micro-batches, of the mean loss, the gradient of ``head`` (the last stage's; zero
    elsewhere) and that of the inputs ``xs`` (stage 0's; zero elsewhere)."""
    stage_fn, _, own, xs, _, stage_axis, _ = p.parts()
    n_stages = primitives.world_size(stage_axis)
    s = primitives.rank(stage_axis)
    last = n_stages - 1
    m = xs.shape[0]
    mv = m * v
    carry, chunk_zeros = _first_carry(p, v, act)
    zero, _, _, _, _, loss0, head0, _ = carry
    up = [(i, (i + 1) % n_stages) for i in range(n_stages)]  # the last stage wraps to 0
    down = [((i + 1) % n_stages, i) for i in range(n_stages)]

    def one_round(carry, k):
        act_in, ct_in, saved, holder, acc, loss, acc_head, d_xs = carry
        f, b = round_items(k, s, n_stages, v)
        fwd, bwd = (f >= 0) & (f < mv), (b >= 0) & (b < mv)
        fi, fc = item(jnp.clip(f, 0, mv - 1), n_stages, v, backward=False)
        bi, bc = item(jnp.clip(b, 0, mv - 1), n_stages, v, backward=True)

        at_loss = fwd & (s == last) & (fc == v - 1)
        out, inp, d_out, value, d_head = lax.switch(
            jnp.where(at_loss, 2, jnp.where(fwd, 1, 0)),
            _forward_branches(p, v, (zero, zero, zero, loss0, head0), s, fi, fc, act_in),
        )
        free = jnp.argmax(holder < 0)
        saved = saved.at[free].set(jnp.where(fwd, inp, saved[free]))
        holder = holder.at[free].set(jnp.where(fwd, f, holder[free]))
        loss = loss + jnp.where(at_loss, value, 0.0)
        acc_head = jax.tree_util.tree_map(
            lambda a, d: a + jnp.where(at_loss, d, jnp.zeros_like(d)), acc_head, d_head
        )
        # -> activations one stage up the ring (stage S - 1's go to stage 0's next chunk)
        act_in = primitives.sendrecv(out, stage_axis, up)

        slot = jnp.argmax(holder == position(bi, bc, n_stages, v))
        kept = saved[slot]

        def run_backward():
            # The model's last chunk starts from the loss's cotangent of this round's forward.
            ct = jnp.where((s == last) & (bc == v - 1), d_out, ct_in)
            _, vjp = jax.vjp(p.at(bi), _chunk(own, bc), kept)
            d_params, d_input = vjp(ct)
            return _typed((d_input, d_params), (zero, chunk_zeros))

        d_input, d_params = lax.cond(bwd, run_backward, lambda: (zero, chunk_zeros))
        acc = jax.tree_util.tree_map(
            lambda a, d: a.at[bc].add(jnp.where(bwd, d, jnp.zeros_like(d))), acc, d_params
        )
        holder = holder.at[slot].set(jnp.where(bwd, -1, holder[slot]))
        first = bwd & (s == 0) & (bc == 0)  # the model's first chunk: the inputs' gradient
        d_xs = _put(d_xs, bi, jnp.where(first, d_input, _at(d_xs, bi)))
        # <- cotangents one stage down the ring (stage 0's go to stage S - 1's previous chunk)
        ct_in = primitives.sendrecv(d_input, stage_axis, down)
        return (act_in, ct_in, saved, holder, acc, loss, acc_head, d_xs), None

    (*_, grads, loss, d_head, d_xs), _ = lax.scan(
        one_round, carry, jnp.arange(rounds(n_stages, v, m))
    )
    return loss / m, grads, d_head, d_xs
