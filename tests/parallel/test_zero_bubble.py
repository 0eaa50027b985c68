"""ZB-H1's lowering cuts a stage's backward in two: B (the input's gradient, the forward
recomputed) and W (the params' gradient, from what B saved, recomputing nothing). Together
they are the stage's vjp, value for value, and cost what 1F1B's backward does; through W's
buffers (B writing, W reading micro-batch w's entries in place) too. Its messages are planned
one into and one out of a stage a slot, each in time; a compiled slot runs one collective and
copies no buffer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from benchmarks.hlo_stats import computations
from jaxcoll import parallel
from jaxcoll.parallel._backward_split import _Split
from jaxcoll.parallel._zero_bubble import COTANGENT, GRAD, HELD, OUT, kept_for_w, transfers


def block(h, w):
    return h + jnp.tanh(h @ w["a"] + w["c"]) @ w["b"], None


def stage(blocks, h):  # layers stacked, a scan over them: B's and W's scans are cut from it
    return jax.lax.scan(block, h, blocks)[0]


def unrolled(blocks, h):
    return jax.lax.scan(block, h, blocks, unroll=True)[0]


def _problem(rows=4, width=8):
    rng = np.random.default_rng(0)
    own = {
        "a": jnp.asarray(rng.normal(size=(3, width, 2 * width)) * 0.3, jnp.float32),
        "b": jnp.asarray(rng.normal(size=(3, 2 * width, width)) * 0.3, jnp.float32),
        "c": jnp.asarray(rng.normal(size=(3, 2 * width)) * 0.1, jnp.float32),
    }
    h = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    return own, h, ct


def _flops(f, *args):
    cost = jax.jit(f).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_w_recomputes_nothing():
    # B and W together cost 1F1B's backward (the forward recomputed once, every gradient
    # once); W alone costs the weight-gradient matmuls, no more than a forward. (Matmuls of
    # some size: B's and W's index arithmetic into their buffers is a few hundred FLOPs.)
    own, h, ct = _problem(rows=32, width=64)
    split = _Split(unrolled, own, h)
    bufs = [jnp.zeros((1, *shape), dtype) for shape, dtype, _ in split.saved_types()]

    def run_b(own, h, ct, bufs):
        return split.run_b(own, h, ct, into=(bufs, 0))

    b, w = _flops(run_b, own, h, ct, bufs), _flops(lambda b: split.run_w(b, 0), bufs)
    both = _flops(lambda o, x, c: jax.vjp(unrolled, o, x)[1](c), own, h, ct)
    forward = _flops(unrolled, own, h)
    assert b + w <= both * 1.01, (b, w, both)
    assert w <= forward * 1.01, (w, forward)


def test_what_b_saves_is_kept_until_its_w():
    rows = parallel.ZeroBubble(8).table(4)
    # The last stage runs B of micro-batches 0..3 before the W of 0.
    assert kept_for_w(rows) == 4
    assert kept_for_w(parallel.ZeroBubble(2).table(4)) == 2


def test_b_and_w_are_the_stage_s_vjp():
    # B writes what W needs into micro-batch 1's entries of 3-deep buffers (in place, inside
    # its scans); W reads them there. The gradients are the vjp's, for a scan over layers, the
    # same unrolled and no scan; the other entries untouched.
    own, h, ct = _problem()
    for fn in (stage, unrolled, lambda p, x: jnp.tanh(x @ p["a"][0]) @ p["b"][0]):
        split = _Split(fn, own, h)
        bufs = [jnp.full((3, *shape), 7.0, dtype) for shape, dtype, _ in split.saved_types()]
        d_h, bufs = jax.jit(lambda o, x, c, b, sp=split: sp.run_b(o, x, c, into=(b, 1)))(
            own, h, ct, bufs
        )
        d_own = jax.jit(lambda b, sp=split: sp.run_w(b, jnp.int32(1)))(bufs)
        want_own, want_h = jax.vjp(fn, own, h)[1](ct)
        np.testing.assert_allclose(d_h, want_h, rtol=1e-6, atol=1e-6)
        for name in own:
            np.testing.assert_allclose(d_own[name], want_own[name], rtol=1e-6, atol=1e-6)
        for buf in bufs:
            assert np.all(np.asarray(buf)[[0, 2]] == 7.0)


def test_every_message_goes_one_stage_a_slot_and_arrives_in_time():
    # An oracle from the table alone: every forward's output (but the last stage's) must reach
    # the next stage, every B's gradient (but stage 0's) the previous one, before the slot
    # that uses it; replayed from the plan, one message out of and one into a stage a slot.
    for stages in range(2, 9):
        for m in range(1, 25):
            rows = parallel.ZeroBubble(m).table(stages)
            plan = transfers(rows)
            when = {(s, op): t for s, row in enumerate(rows) for t, op in enumerate(row) if op}
            arrived, outbox = {}, [None] * stages
            for t in range(len(rows[0])):
                pairs = plan["patterns"][plan["pattern"][t]]
                assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == len(pairs)
                for s, dst in pairs:
                    what, op = plan["send"][s, t], rows[s][t]
                    if what == OUT:
                        assert dst == s + 1 and op[0] == "F"
                        message = ("F", op[1])
                    elif what == GRAD:
                        assert dst == s - 1 and op[0] == "B"
                        message = ("B", op[1])
                    else:
                        assert what == HELD and dst == s - 1 and outbox[s] is not None
                        message, outbox[s] = outbox[s], None
                    assert plan["recv_mb"][dst, t] == message[1]
                    assert (plan["recv"][dst, t] == COTANGENT) == (message[0] == "B")
                    arrived[(dst, message)] = t
                for s in range(stages):
                    if plan["hold"][s, t]:
                        assert outbox[s] is None and rows[s][t][0] == "B"
                        outbox[s] = ("B", rows[s][t][1])
            for (s, (kind, k)), t in when.items():
                if kind == "F" and s > 0:
                    assert arrived[(s, ("F", k))] < t, (stages, m, s, kind, k)
                if kind == "B" and s < stages - 1:
                    assert arrived[(s, ("B", k))] < t, (stages, m, s, kind, k)
            assert len(arrived) == 2 * m * (stages - 1)


def _called(comps: dict, name: str) -> set:
    """``name`` and every computation it calls, transitively."""
    seen, todo = {name}, [name]
    while todo:
        for line in comps.get(todo.pop(), []):
            for key in ("branch_computations={", "calls=", "body=", "to_apply="):
                if key in line:
                    for callee in line.split(key)[1].split("}")[0].split(", ")[:64]:
                        callee = callee.split(",")[0].strip().lstrip("%")
                        if callee in comps and callee not in seen:
                            seen.add(callee)
                            todo.append(callee)
    return seen


def test_a_slot_runs_one_sendrecv_and_copies_no_buffer():
    # The compiled slot (the scan over the table's 3M + S - 1 slots): no collective-permute
    # in the slot itself, one in each branch of the slot's switch on its pattern (one
    # rendezvous a slot on XLA:CPU, not one per direction); and no copy bigger than one
    # activation anywhere in it (an idle or W-less slot passes the accumulated gradient and
    # W's buffers through; B and W write and read them in place).
    layers, width, rows = 8, 16, 4
    mesh = Mesh(np.array(jax.devices()[:4]), ("stage",))
    rng = np.random.default_rng(0)
    blocks = {
        "a": jnp.asarray(rng.normal(size=(layers, width, 4 * width)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(layers, 4 * width, width)), jnp.float32),
        "c": jnp.zeros((layers, 4 * width), jnp.float32),
    }
    h = jnp.ones((8 * rows, width), jnp.float32)

    def loss(blocks, h):
        return parallel.pipeline_loss(
            stage,
            lambda head, out, y: jnp.mean((out - y) ** 2),
            blocks,
            {},
            h,
            h,
            axis_name="stage",
            schedule=parallel.ZeroBubble(8),
        )

    spec = {k: P("stage") for k in blocks}
    grad = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(spec, P()), out_specs=spec))
    comps = computations(grad.lower(blocks, h).compile().as_text())[1]
    loops = {  # the while loops that run a sendrecv: the slots' scan alone
        line.split("body=")[1].split(",")[0].lstrip("%")
        for lines in comps.values()
        for line in lines
        if " while(" in line
    }
    loops = [
        b
        for b in loops
        if any("collective-permute(" in x for c in _called(comps, b) for x in comps[c])
    ]
    assert len(loops) == 1, loops
    slot = _called(comps, loops[0])
    permutes = {c: sum("collective-permute(" in x for x in comps[c]) for c in slot}
    assert permutes[loops[0]] == 0
    assert 1 <= sum(permutes.values()) and max(permutes.values()) == 1
    activation = rows * width * 4
    for c in slot:
        for line in comps[c]:
            if " copy(" in line:
                dims = line.split("= f32[")[1].split("]")[0] if "= f32[" in line else ""
                size = 4 * int(np.prod([int(d) for d in dims.split(",") if d]))
                assert size <= activation, (c, line.strip()[:120])
