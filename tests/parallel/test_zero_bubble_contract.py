"""ZB-H1's contract, each part against an oracle of its own.

* The order of a stage's operations is ZB-H1's (Qi et al., "Zero Bubble Pipeline
  Parallelism", 2023, Figure 3 top; written here from the paper's definition): as 1F1B, stage
  s runs S - s forwards before its first B (S - s - 1 warm-up forwards, then F and B
  alternate), and holds its W's back by s steps so that every stage has as many micro-batches
  in flight as 1F1B's first stage: s steady steps of F and B, then F, B and the oldest W owed
  while forwards remain, then B and W, then the W's still owed.
* The table runs each stage's order as early as its inputs allow (an earliest-slot recurrence
  here, not the schedule's slot-by-slot simulation).
* In flight (a micro-batch's forward run, its W not yet): min(S, M) at most, and exactly, on
  every stage: the activation memory bound; :meth:`kept_inputs` says the same; for M >= S
  the step is 3M + S - 1 slots of which each stage idles S - 1.
* Run: the loss and the gradients (the stages', the head's, and the input's row by row, so
  each micro-batch's own) equal the dense model's, for a loss weighted row by row (so no two
  micro-batches have the same cotangent: one written into another micro-batch's buffer gives
  a wrong gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import parallel
from tests.helpers import mesh_1d

Op = tuple[str, int]


def zb_h1_order(stages: int, s: int, m: int) -> list[Op]:
    """Stage ``s``'s operations in ZB-H1, from the paper's definition (see the module)."""
    warm = min(stages - s - 1, m)  # forward-only warm-up
    steady = m - warm  # steps that run a forward and a B
    ops: list[Op] = [("F", k) for k in range(warm)]
    for j in range(steady):
        ops += [("F", warm + j), ("B", j)]
        if j >= s:  # W held back by s steps
            ops.append(("W", j - s))
    owed = max(0, steady - s)  # the oldest W not yet run
    for k in range(steady, m):  # no forward left: B, then the oldest W owed
        ops += [("B", k), ("W", owed)]
        owed += 1
    return ops + [("W", k) for k in range(owed, m)]


def earliest_slots(orders: list[list[Op]]) -> list[list[Op | None]]:
    """Each stage's order placed at the earliest slot its dependencies allow: one operation a
    slot and a stage, in order; F of micro-batch k after F of k on the stage before (its
    output arrives a slot later); B of k after B of k on the stage after; as rows of slots."""
    stages = len(orders)
    when: list[dict[Op, int]] = [{} for _ in range(stages)]
    placed = [0] * stages
    while any(placed[s] < len(orders[s]) for s in range(stages)):
        progress = False
        for s in range(stages):
            while placed[s] < len(orders[s]):
                kind, k = op = orders[s][placed[s]]
                dep = None
                if kind == "F" and s > 0:
                    dep = (s - 1, ("F", k))
                elif kind == "B" and s < stages - 1:
                    dep = (s + 1, ("B", k))
                if dep is not None and dep[1] not in when[dep[0]]:
                    break
                t = when[s][orders[s][placed[s] - 1]] + 1 if placed[s] else 0
                if dep is not None:
                    t = max(t, when[dep[0]][dep[1]] + 1)
                when[s][op] = t
                placed[s] += 1
                progress = True
        assert progress, "the orders deadlock"
    slots = 1 + max(t for w in when for t in w.values())
    rows: list[list[Op | None]] = [[None] * slots for _ in range(stages)]
    for s in range(stages):
        for op, t in when[s].items():
            rows[s][t] = op
    return rows


def in_flight(row: list[Op | None]) -> int:
    """The most micro-batches whose forward ran and whose W did not yet, in one row."""
    live = most = 0
    for op in row:
        live += op is not None and op[0] == "F"
        most = max(most, live)
        live -= op is not None and op[0] == "W"
    return most


MICRO_BATCHES = range(1, 13)


def test_the_paper_s_sequence_at_4_stages_8_micro_batches():
    # Figure 3 (top) of the paper, written out by hand: stage 0 runs 3 warm-up forwards and
    # then F, B, W at once; stage 3 runs F and B four times, its first W after the fourth B.
    f, b, w = (lambda k, c=c: (c, k) for c in "FBW")
    assert zb_h1_order(4, 0, 8)[:10] == [f(0), f(1), f(2), f(3), b(0), w(0), f(4), b(1), w(1), f(5)]
    assert zb_h1_order(4, 3, 8)[:10] == [f(0), b(0), f(1), b(1), f(2), b(2), f(3), b(3), w(0), f(4)]
    assert zb_h1_order(4, 3, 8)[-4:] == [w(4), w(5), w(6), w(7)]
    for s in range(4):
        assert parallel.ZeroBubble(8).order(4, s) == zb_h1_order(4, s, 8), s


@pytest.mark.parametrize("stages", range(1, 9), ids=lambda s: f"S={s}")
def test_each_stage_runs_zb_h1_s_order(stages):
    for m in MICRO_BATCHES:
        zb = parallel.ZeroBubble(m)
        for s in range(stages):
            got, want = zb.order(stages, s), zb_h1_order(stages, s, m)
            assert got == want, (m, s, got, want)
            # The forwards before the first B: 1F1B's warm-up and one.
            first_b = next(i for i, op in enumerate(got) if op[0] == "B")
            assert first_b == min(stages - s, m), (m, s, got)


@pytest.mark.parametrize("stages", range(1, 9), ids=lambda s: f"S={s}")
def test_the_table_runs_each_order_as_early_as_its_inputs_allow(stages):
    for m in MICRO_BATCHES:
        zb = parallel.ZeroBubble(m)
        rows = zb.table(stages)
        want = earliest_slots([zb_h1_order(stages, s, m) for s in range(stages)])
        # In flight: min(S, M) on every stage (1F1B's first stage's), the memory bound.
        assert [in_flight(row) for row in rows] == [min(stages, m)] * stages, m
        assert zb.kept_inputs(stages) == min(stages, m), m
        assert rows == want, m
        if m >= stages:  # 3M + S - 1 slots, S - 1 idle on every stage (1F1B: 3(S - 1))
            assert len(rows[0]) == 3 * m + stages - 1, m
            assert [row.count(None) for row in rows] == [stages - 1] * stages, m
            assert zb.bubble_fraction(stages) == (stages - 1) / (3 * m + stages - 1), m


# ------------------------------------------------------------------ run, against the dense model
S, W, ROWS = 4, 8, 24  # stages, width, rows of the batch


def stage_fn(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def head_fn(head, h, y):
    """A weighted squared error: every row its own weight, so every micro-batch its own
    cotangent."""
    return jnp.mean(y["weight"][:, None] * (h @ head["out"] - y["target"]) ** 2)


def _problem():
    rng = np.random.default_rng(43)
    blocks = {
        "w": (rng.normal(size=(S, W, W)) / np.sqrt(W)).astype(np.float32),
        "b": (rng.normal(size=(S, W)) * 0.1).astype(np.float32),
    }
    head = {"out": (rng.normal(size=(W, 3)) * 0.5).astype(np.float32)}
    x = rng.normal(size=(ROWS, W)).astype(np.float32)
    y = {
        "target": rng.normal(size=(ROWS, 3)).astype(np.float32),
        # Weights from 0.1 to 10, in no order: micro-batches differ in their cotangents.
        "weight": rng.permutation(np.geomspace(0.1, 10.0, ROWS)).astype(np.float32),
    }
    return blocks, head, x, y


def _dense_loss(blocks, head, x, y):
    h = x
    for s in range(S):
        h = stage_fn(jax.tree.map(lambda v, s=s: v[s], blocks), h)
    return head_fn(head, h, y)


@pytest.mark.parametrize("m", [6, 3], ids=lambda m: f"M={m}")
def test_zb_h1_gives_each_micro_batch_the_dense_model_s_gradients(m):
    # M=6: more micro-batches than the 4 stages, buffers reused (micro-batch k in k mod 4);
    # M=3: fewer.
    blocks, head, x, y = _problem()
    mesh = mesh_1d(S, "stage")

    def body(blocks, head, x, y):
        def loss(blocks, head, x):
            return parallel.pipeline_loss(
                stage_fn,
                head_fn,
                jax.tree.map(lambda t: t[0], blocks),
                head,
                x,
                y,
                axis_name="stage",
                schedule=parallel.ZeroBubble(m),
            )

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(blocks, head, x)

    specs = {"w": P("stage"), "b": P("stage")}
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, P(), P(), P()),
            out_specs=(P(), (specs, P(), P())),
        )
    )
    placed = jax.device_put(blocks, NamedSharding(mesh, P("stage")))
    loss, (d_blocks, d_head, d_x) = f(placed, head, x, y)
    want_loss, (w_blocks, w_head, w_x) = jax.value_and_grad(_dense_loss, argnums=(0, 1, 2))(
        blocks, head, x, y
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    rows = ROWS // m
    for k in range(m):  # the input's gradient, micro-batch by micro-batch
        mine = slice(k * rows, (k + 1) * rows)
        np.testing.assert_allclose(
            d_x[mine], w_x[mine], rtol=1e-4, atol=1e-6, err_msg=f"micro-batch {k}'s input"
        )
    for name in blocks:
        np.testing.assert_allclose(d_blocks[name], w_blocks[name], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(d_head["out"], w_head["out"], rtol=1e-4, atol=1e-6)
