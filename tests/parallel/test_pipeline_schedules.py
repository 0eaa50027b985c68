"""The pipeline's schedules, as values (``parallel.GPipe``, ``parallel.OneFOneB``,
``parallel.Interleaved``): 1F1B and interleaved 1F1B give GPipe's loss and gradients (and the
dense model's), on their own and beside a data axis; they keep fewer activations than GPipe in
the compiled program, a number that does not grow with the micro-batches; the interleaved
schedule's table (every dependency, the buffers, the idle slots) and each value's bubble and
kept inputs; bad values. A schedule's name (``schedule="1f1b"``) is refused, naming the value
to pass; the stage axis defaults to the role ``"pipeline"``."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import parallel
from jaxcoll.parallel import _interleaved
from tests.helpers import mesh_1d, mesh_2d

S, W = 4, 8


def stage_fn(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def loss_fn(h, y):
    """A pytree of targets: per-example weights scale the squared error (a mean)."""
    return jnp.mean(y["weight"][:, None] * (h - y["target"]) ** 2)


def _problem(batch):
    rng = np.random.default_rng(batch)
    params = {
        "w": (rng.normal(size=(S, W, W)) / np.sqrt(W)).astype(np.float32),
        "b": rng.normal(size=(S, W)).astype(np.float32) * 0.1,
    }
    x = rng.normal(size=(batch, W)).astype(np.float32)
    y = {
        "target": rng.normal(size=(batch, W)).astype(np.float32),
        "weight": rng.uniform(0.5, 1.5, size=batch).astype(np.float32),
    }
    return params, x, y


def _dense(params, x, y):
    """The same model on one device, the whole batch at once."""

    def model_loss(p):
        h = x
        for s in range(S):
            h = stage_fn(jax.tree.map(lambda v, s=s: v[s], p), h)
        return loss_fn(h, y)

    return jax.value_and_grad(model_loss)(params)


def _check_grads(got_loss, got_grads, params, x, y):
    want_loss, want_grads = _dense(params, x, y)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(got_grads[k], want_grads[k], rtol=1e-4, atol=1e-6)


def _both(axis_name, m, data_axis_name=None):
    """A shard_map body that runs GPipe and 1F1B (one compiled program for the two)."""

    def body(p, x, y):
        mine = jax.tree.map(lambda v: v[0], p)
        out = []
        for schedule in (parallel.GPipe(m), parallel.OneFOneB(m)):
            loss, g = parallel.pipeline_value_and_grad(
                stage_fn,
                loss_fn,
                mine,
                x,
                y,
                axis_name=axis_name,
                schedule=schedule,
                data_axis_name=data_axis_name,
            )
            out.append((loss, jax.tree.map(lambda v: v[None], g)))
        return tuple(out)

    return body


@pytest.mark.parametrize("m", [4, 8])
def test_1f1b_equals_gpipe_and_the_dense_model(m):
    mesh = mesh_1d(S, "stage")
    params, x, y = _problem(16)
    f = jax.jit(
        jax.shard_map(
            _both("stage", m),
            mesh=mesh,
            in_specs=(P("stage"), P(), P()),
            out_specs=((P(), P("stage")),) * 2,
        )
    )
    (g_loss, g_grads), (o_loss, o_grads) = f(
        jax.device_put(params, NamedSharding(mesh, P("stage"))), x, y
    )
    _check_grads(o_loss, o_grads, params, x, y)
    _check_grads(g_loss, g_grads, params, x, y)
    np.testing.assert_allclose(o_loss, g_loss, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(o_grads[k], g_grads[k], rtol=1e-5, atol=1e-7)


def test_1f1b_with_a_data_axis_averages_the_replicas_once():
    mesh = mesh_2d(2, S)  # ("node", "local"): 2 replicas x 4 stages
    params, x, y = _problem(32)  # 16 examples per replica
    f = jax.jit(
        jax.shard_map(
            _both("local", 2, data_axis_name="node"),  # 2 micro-batches: fewer than the stages
            mesh=mesh,
            in_specs=(P("local"), P("node"), P("node")),
            out_specs=((P(), P("local")),) * 2,
        )
    )
    data = NamedSharding(mesh, P("node"))
    (g_loss, g_grads), (o_loss, o_grads) = f(
        jax.device_put(params, NamedSharding(mesh, P("local"))),
        jax.device_put(x, data),
        jax.device_put(y, data),
    )
    _check_grads(o_loss, o_grads, params, x, y)
    _check_grads(g_loss, g_grads, params, x, y)


V = 2  # virtual stages: a model of S * V = 8 chunks


def _chunked_problem(batch):
    """A model of S * V chunks, ``(S * V, ...)`` params in model order."""
    rng = np.random.default_rng(batch + 1)
    params = {
        "w": (rng.normal(size=(S * V, W, W)) / np.sqrt(W)).astype(np.float32),
        "b": rng.normal(size=(S * V, W)).astype(np.float32) * 0.1,
    }
    x = rng.normal(size=(batch, W)).astype(np.float32)
    y = {
        "target": rng.normal(size=(batch, W)).astype(np.float32),
        "weight": rng.uniform(0.5, 1.5, size=batch).astype(np.float32),
    }
    return params, x, y


def _dense_chunks(params, x, y):
    def model_loss(p):
        h = x
        for k in range(S * V):
            h = stage_fn(jax.tree.map(lambda t, k=k: t[k], p), h)
        return loss_fn(h, y)

    return jax.value_and_grad(model_loss)(params)


def _two_chunks(p, h):
    """GPipe's and 1F1B's stage s: chunks 2s and 2s + 1, in order."""
    for c in range(V):
        h = stage_fn(jax.tree.map(lambda t, c=c: t[c], p), h)
    return h


def _values(m):
    """The three schedules' values, as keyword arguments."""
    return (
        {"schedule": parallel.GPipe(m)},
        {"schedule": parallel.OneFOneB(m)},
        {"schedule": parallel.Interleaved(m, virtual=V)},
    )


def _three(axis_name, spelled, data_axis_name=None):
    """One shard_map body running GPipe and 1F1B (stage s: model chunks Vs..Vs+V-1) and the
    interleaved schedule (stage s: chunks s, s + S), given as ``spelled``: one compiled
    program for the three."""

    def body(contiguous, ring, x, y):
        out = []
        for schedule, p, fn in zip(
            spelled, (contiguous, contiguous, ring), (_two_chunks, _two_chunks, stage_fn)
        ):
            loss, g = parallel.pipeline_value_and_grad(
                fn,
                loss_fn,
                jax.tree.map(lambda t: t[0], p),
                x,
                y,
                axis_name=axis_name,
                data_axis_name=data_axis_name,
                **schedule,
            )
            out.append((loss, jax.tree.map(lambda t: t[None], g)))
        return tuple(out)

    return body


@functools.cache
def _three_run(m, data):
    """The chunked problem and the three schedules' ``(loss, grads)`` (host arrays, grads
    ``(S, V, ...)`` as each schedule places the chunks), 4 stages or 2 data x 4 stages.
    Cached: the program compiles once per case."""
    if data:
        mesh, stage_axis, data_axis = mesh_2d(2, S), "local", "node"  # all 8 devices
        params, x, y = _chunked_problem(32)  # 16 examples per replica
    else:
        mesh, stage_axis, data_axis = mesh_1d(S, "stage"), "stage", None
        params, x, y = _chunked_problem(16)
    rows = P(data_axis) if data else P()
    f = jax.jit(
        jax.shard_map(
            _three(stage_axis, _values(m), data_axis),
            mesh=mesh,
            in_specs=(P(stage_axis), P(stage_axis), rows, rows),
            out_specs=((P(), P(stage_axis)),) * 3,
        )
    )
    # GPipe/1F1B stage s holds chunks (2s, 2s + 1); interleaved stage s holds (s, s + 4).
    contiguous = jax.tree.map(lambda t: t.reshape((S, V) + t.shape[1:]), params)
    ring = jax.tree.map(lambda t: t.reshape((V, S) + t.shape[1:]).swapaxes(0, 1), params)
    staged = NamedSharding(mesh, P(stage_axis))
    results = f(
        jax.device_put(contiguous, staged),
        jax.device_put(ring, staged),
        jax.device_put(x, NamedSharding(mesh, rows)),
        jax.device_put(y, NamedSharding(mesh, rows)),
    )
    return (params, x, y), jax.tree.map(np.asarray, results)


@pytest.mark.parametrize("data", [False, True], ids=["4-stages", "2-data-x-4-stages"])
@pytest.mark.parametrize("m", [4, 8])
def test_interleaved_equals_gpipe_1f1b_and_the_dense_model(m, data):
    (params, x, y), results = _three_run(m, data)
    model_order = (
        lambda g: g.reshape((S * V,) + g.shape[2:]),  # (S, V) -> chunk V s + c
        lambda g: g.reshape((S * V,) + g.shape[2:]),
        lambda g: g.swapaxes(0, 1).reshape((S * V,) + g.shape[2:]),  # (S, V) -> chunk c S + s
    )
    (gpipe_loss, gpipe_grads), *_ = results
    want_loss, want_grads = _dense_chunks(params, x, y)
    for (loss, grads), order in zip(results, model_order, strict=True):
        grads = jax.tree.map(lambda g, order=order: order(np.asarray(g)), grads)
        np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-5)
        np.testing.assert_allclose(loss, gpipe_loss, rtol=0, atol=1e-5)
        for k in params:
            np.testing.assert_allclose(grads[k], want_grads[k], rtol=0, atol=1e-5)
            np.testing.assert_allclose(
                grads[k], model_order[0](np.asarray(gpipe_grads[k])), rtol=0, atol=1e-5
            )


def _table(n_stages, v, m):
    """The interleaved schedule on the host, from the lowering's own index formulas: per
    round and stage, the (micro-batch, chunk) of the forward and of the backward, or None."""
    out = []
    for k in range(_interleaved.rounds(n_stages, v, m)):
        row = []
        for s in range(n_stages):
            f, b = _interleaved.round_items(k, s, n_stages, v)
            row.append(
                (
                    _interleaved.item(f, n_stages, v, backward=False) if 0 <= f < m * v else None,
                    _interleaved.item(b, n_stages, v, backward=True) if 0 <= b < m * v else None,
                )
            )
        out.append(row)
    return out


@pytest.mark.parametrize(
    "n_stages, v, m",
    [(4, 2, 4), (4, 2, 8), (4, 3, 12), (3, 2, 6), (1, 3, 2), (2, 1, 3), (8, 4, 16)],
)
def test_the_interleaved_table_keeps_every_dependency_and_its_idle_slots_are_the_bubble(
    n_stages, v, m
):
    schedule = parallel.Interleaved(m, virtual=v)
    table = _table(n_stages, v, m)
    fwd, bwd = {}, {}  # (stage, micro-batch, chunk) -> round
    for k, row in enumerate(table):
        for s, (f, b) in enumerate(row):
            if f is not None:
                assert (s, *f) not in fwd
                fwd[(s, *f)] = k
            if b is not None:
                assert (s, *b) not in bwd
                bwd[(s, *b)] = k
    everything = {(s, i, c) for s in range(n_stages) for i in range(m) for c in range(v)}
    assert set(fwd) == set(bwd) == everything
    last = n_stages - 1
    for s, i, c in everything:
        # A forward's input was made in the round before, one stage down the ring...
        if (s, c) != (0, 0):
            src = (s - 1, i, c) if s else (last, i, c - 1)
            assert fwd[src] == fwd[s, i, c] - 1, (s, i, c)
        # ... and a backward's cotangent one stage up; the model's last chunk starts from the
        # loss in the round of its forward.
        if (s, c) == (last, v - 1):
            assert bwd[s, i, c] == fwd[s, i, c]
        else:
            src = (s + 1, i, c) if s < last else (0, i, c + 1)
            assert bwd[src] == bwd[s, i, c] - 1, (s, i, c)
    # Inputs kept at once (a forward's before that round's backward frees one): the buffers
    # the lowering allocates, and the value's kept_inputs.
    peak = max(
        sum(fwd[s, i, c] <= k <= bwd[s, i, c] for i in range(m) for c in range(v))
        for s in range(n_stages)
        for k in range(len(table))
    )
    assert peak == _interleaved.buffers(n_stages, v, m) == schedule.kept_inputs(n_stages)
    # Slots: the forward and backward halves in which some stage computes; every stage is idle
    # in the same number of them, the bubble.
    halves = [sum(any(r[s][h] for s in range(n_stages)) for r in table) for h in (0, 1)]
    for s in range(n_stages):
        busy = sum((r[s][0] is not None) + (r[s][1] is not None) for r in table)
        assert busy == 2 * m * v
        idle = (sum(halves) - busy) / sum(halves)
        assert idle == schedule.bubble_fraction(n_stages), (s, idle)


@functools.cache
def _temp_bytes(schedule, rows=64, width=256):
    """Temp bytes of one compiled pipeline step whose activations dominate: micro-batches of
    (rows, width) float32 through a 16 x 16 block matmul per stage, or per chunk with
    ``Interleaved`` (1 KiB of params each)."""

    def block(w, h):
        return jnp.tanh((h.reshape(-1, 16, 16) @ w).reshape(h.shape))

    def mse(h, y):
        return jnp.mean((h - y) ** 2)

    def body(w, x, y):
        loss, g = parallel.pipeline_value_and_grad(
            block, mse, w[0], x, y, axis_name="stage", schedule=schedule
        )
        return loss, g[None]

    mesh = mesh_1d(S, "stage")
    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P(), P()), out_specs=(P(), P("stage")))
    )
    chunks = (schedule.virtual,) if isinstance(schedule, parallel.Interleaved) else ()
    w = jax.ShapeDtypeStruct((S,) + chunks + (16, 16), jnp.float32)
    x = jax.ShapeDtypeStruct((schedule.microbatches * rows, width), jnp.float32)
    return f.lower(w, x, x).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_keeps_under_half_of_gpipes_temp_memory_and_does_not_grow_with_m():
    # 4 stages, 16 micro-batches of 64 KiB: GPipe keeps all 16 stage inputs (and outputs),
    # 1F1B 4 stage inputs; measured 3211928 vs 1182248 bytes (jax 0.10, XLA:CPU).
    gpipe, one_f_one_b = _temp_bytes(parallel.GPipe(16)), _temp_bytes(parallel.OneFOneB(16))
    print(f"temp bytes, 4 stages x 16 micro-batches: gpipe {gpipe}, 1f1b {one_f_one_b}")
    assert one_f_one_b <= 0.5 * gpipe, (gpipe, one_f_one_b)
    # Twice the micro-batches: GPipe's buffers double, 1F1B's stay min(S, M) = 4 deep.
    assert parallel.OneFOneB(32).kept_inputs(S) == parallel.OneFOneB(16).kept_inputs(S) == 4
    assert _temp_bytes(parallel.OneFOneB(32)) <= 1.05 * one_f_one_b


def test_interleaved_temp_memory_is_bounded_as_m_grows():
    # 4 stages x 2 chunks keep min(2M, 11) chunk inputs: 8 at M = 4, then 11 from M = 8 on.
    # Measured (jax 0.10, XLA:CPU) at M = 4, 8, 16, 32: 1051944, 1248552, 1248616, 1248744
    # bytes; GPipe's 918488, 1639000, 3211928, 6357720.
    inter = {m: _temp_bytes(parallel.Interleaved(m, virtual=2)) for m in (8, 16, 32)}
    print(f"temp bytes, interleaved 4 stages x 2 chunks, M = 8, 16, 32: {inter}")
    assert {parallel.Interleaved(m, virtual=2).kept_inputs(S) for m in inter} == {11}
    assert inter[32] <= 1.05 * inter[8], inter
    assert inter[16] <= 0.5 * _temp_bytes(parallel.GPipe(16)), inter


def test_a_schedule_is_a_frozen_value():
    gpipe, one_f_one_b, inter = parallel.GPipe(8), parallel.OneFOneB(8), parallel.Interleaved(8)
    assert [(s.name, s.microbatches, s.virtual) for s in (gpipe, one_f_one_b, inter)] == [
        ("gpipe", 8, 1),
        ("1f1b", 8, 1),
        ("interleaved", 8, 2),  # two chunks per stage unless told
    ]
    assert all(isinstance(s, parallel.Schedule) for s in (gpipe, one_f_one_b, inter))
    assert gpipe == parallel.GPipe(8) and hash(gpipe) == hash(parallel.GPipe(8))
    assert gpipe != one_f_one_b  # the same M, another schedule
    assert parallel.Interleaved(8, 2) == inter != parallel.Interleaved(8, virtual=4)
    assert repr(inter) == "Interleaved(microbatches=8, virtual=2)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpipe.microbatches = 4


@pytest.mark.parametrize("schedule", [parallel.GPipe, parallel.OneFOneB], ids=["gpipe", "1f1b"])
def test_bubble_fraction_of_gpipe_and_1f1b(schedule):
    # 2(M + S - 1) slots per stage, 2M busy: (S - 1) / (M + S - 1) for both schedules.
    assert schedule(8).bubble_fraction(4) == 3 / 11
    assert schedule(16).bubble_fraction(4) == 3 / 19
    assert schedule(8).bubble_fraction(8) == 7 / 15
    assert schedule(5).bubble_fraction(1) == 0.0


def test_bubble_fraction_of_the_interleaved_schedule():
    # 2(vM + S - 1) chunk slots, 2vM busy: (S - 1) / (vM + S - 1), Megatron's bubble.
    inter = parallel.Interleaved
    assert (
        inter(8, virtual=2).bubble_fraction(4) == 3 / 19 < parallel.OneFOneB(8).bubble_fraction(4)
    )
    assert inter(4, virtual=2).bubble_fraction(4) == 3 / 11
    assert inter(16, virtual=4).bubble_fraction(4) == 3 / 67
    assert inter(8, virtual=2).bubble_fraction(8) == 7 / 23
    # One chunk per stage: any M, and 1F1B's bubble.
    assert (
        inter(6, virtual=1).bubble_fraction(4) == parallel.OneFOneB(6).bubble_fraction(4) == 1 / 3
    )


@pytest.mark.parametrize(
    "schedule, stages, kept",
    [
        (parallel.GPipe(8), 4, 8),  # all M
        (parallel.GPipe(2), 4, 2),
        (parallel.GPipe(16), 1, 16),
        (parallel.OneFOneB(8), 4, 4),  # min(S, M)
        (parallel.OneFOneB(2), 4, 2),
        (parallel.OneFOneB(16), 1, 1),
        (parallel.Interleaved(8, virtual=2), 4, 11),  # min(Mv, vS + S - 1) = min(16, 11)
        (parallel.Interleaved(4, virtual=2), 4, 8),  # min(8, 11)
        (parallel.Interleaved(16, virtual=4), 4, 19),  # min(64, 19)
        (parallel.Interleaved(6, virtual=1), 4, 6),  # min(6, 7)
        (parallel.Interleaved(2, virtual=3), 1, 3),  # min(6, 3)
    ],
    ids=str,
)
def test_kept_inputs_of_each_schedule(schedule, stages, kept):
    assert schedule.kept_inputs(stages) == kept


def test_a_stage_count_must_be_a_positive_int():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "GPipe(microbatches=8).bubble_fraction: stages=0 must be a positive int (the size "
            "of the stage axis)."
        ),
    ):
        parallel.GPipe(8).bubble_fraction(0)
    with pytest.raises(
        TypeError, match=r"OneFOneB\(microbatches=8\)\.kept_inputs: .* got 4\.0 instead\."
    ):
        parallel.OneFOneB(8).kept_inputs(4.0)


@pytest.mark.parametrize(
    "make, args, kwargs, error, message",
    [
        (
            parallel.GPipe,
            (0,),
            {},
            ValueError,
            "GPipe: microbatches=0 must be a positive int (micro-batches per step).",
        ),
        (
            parallel.GPipe,
            (2.0,),
            {},
            TypeError,
            "GPipe: microbatches must be an int (micro-batches per step), got 2.0 instead.",
        ),
        (
            parallel.OneFOneB,
            (-1,),
            {},
            ValueError,
            "OneFOneB: microbatches=-1 must be a positive int (micro-batches per step).",
        ),
        (
            parallel.OneFOneB,
            (True,),
            {},
            TypeError,
            "OneFOneB: microbatches must be an int (micro-batches per step), got True instead.",
        ),
        (
            parallel.Interleaved,
            ("8",),
            {},
            TypeError,
            "Interleaved: microbatches must be an int (micro-batches per step), got '8' instead.",
        ),
        (
            parallel.Interleaved,
            (8,),
            {"virtual": 0},
            ValueError,
            "Interleaved: virtual=0 must be a positive int (model chunks per stage).",
        ),
        (
            parallel.Interleaved,
            (8,),
            {"virtual": -2},
            ValueError,
            "Interleaved: virtual=-2 must be a positive int (model chunks per stage).",
        ),
        (
            parallel.Interleaved,
            (8,),
            {"virtual": 2.0},
            TypeError,
            "Interleaved: virtual must be an int (model chunks per stage), got 2.0 instead.",
        ),
        (
            parallel.Interleaved,
            (8,),
            {"virtual": True},
            TypeError,
            "Interleaved: virtual must be an int (model chunks per stage), got True instead.",
        ),
        (
            parallel.Interleaved,
            (8,),
            {"virtual": "2"},
            TypeError,
            "Interleaved: virtual must be an int (model chunks per stage), got '2' instead.",
        ),
        # Chunks belong to the interleaved schedule alone: the others have no such field.
        (parallel.OneFOneB, (8,), {"virtual": 2}, TypeError, "unexpected keyword argument"),
        (parallel.GPipe, (8,), {"virtual": 3}, TypeError, "unexpected keyword argument"),
    ],
)
def test_a_bad_schedule_value_is_refused_when_made(make, args, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make(*args, **kwargs)


def _trace_interleaved(params, **schedule):
    mesh = mesh_1d(S, "stage")

    def body(p, x):
        mine = jax.tree.map(lambda t: t[0], p)
        return parallel.pipeline_value_and_grad(
            lambda p, h: jnp.tanh(h @ p["w"]),
            lambda h, t: jnp.mean((h - t) ** 2),
            mine,
            x,
            x,
            axis_name="stage",
            **schedule,
        )[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P()))
    f.trace(params, jax.ShapeDtypeStruct((12, W), jnp.float32))


CHUNKS = {"w": jax.ShapeDtypeStruct((S, V, W, W), jnp.float32)}
GROUPS = (
    "Interleaved(microbatches=6, virtual=2) runs the micro-batches in groups of one per "
    "stage, so microbatches=6 must be a multiple of the 4 stages (Megatron's rule); pass "
    "Interleaved(8, virtual=2) or another multiple of 4."
)


def test_interleaving_needs_micro_batches_in_groups_of_the_stages():
    six = parallel.Interleaved(6, virtual=2)
    with pytest.raises(ValueError, match=re.escape(f"pipeline_value_and_grad: {GROUPS}")):
        _trace_interleaved(CHUNKS, schedule=six)
    with pytest.raises(ValueError, match=re.escape(f"{six!r}.bubble_fraction: {GROUPS}")):
        six.bubble_fraction(4)
    with pytest.raises(ValueError, match=re.escape(f"{six!r}.kept_inputs: {GROUPS}")):
        six.kept_inputs(4)
    with pytest.raises(ValueError, match=r"api: .* pass Interleaved\(12, virtual=3\) or another"):
        parallel.Interleaved(10, virtual=3).check("api", 4)  # the next multiple of 4
    six.check("api", 3)  # 6 in groups of 3
    assert six.bubble_fraction(3) == 2 / 14 and six.kept_inputs(3) == 8
    parallel.Interleaved(6, virtual=1).check("api", 4)  # one chunk per stage: any M
    _trace_interleaved(CHUNKS, schedule=parallel.Interleaved(4, virtual=2))  # a multiple of 4


def test_interleaving_needs_the_chunks_on_a_leading_axis():
    one_chunk = {"w": jax.ShapeDtypeStruct((S, W, W), jnp.float32)}  # leading axis W, not V
    with pytest.raises(
        ValueError,
        match=r"pipeline_value_and_grad: params\['w'\] has shape \(8, 8\) here \(this "
        r"stage's part, of 4 stages\), but Interleaved\(virtual=2\) needs a leading axis of 2 "
        r"on every leaf, this stage's 2 chunks \(chunk c being model chunk c\*S \+ s\): "
        r"expected \(2, \.\.\.\) .*t\.reshape\(\(2, t\.shape\[0\] // 2\)",
    ):
        _trace_interleaved(one_chunk, schedule=parallel.Interleaved(4, virtual=V))


# ------------------------------------------------ a schedule is a value, never a name
@pytest.mark.parametrize(
    "name, value",
    [
        ("gpipe", "GPipe(M)"),
        ("1f1b", "OneFOneB(M)"),
        ("interleaved", "Interleaved(M, virtual=v)"),
        (parallel.ZeroBubble.name, "ZeroBubble(M)"),
        ("OneFOneB", "OneFOneB(M)"),  # a class's name, as a string
    ],
)
def test_a_schedule_name_is_refused_naming_the_value_to_pass(name, value):
    params, x, y = _problem(8)
    cls = value.split("(")[0]
    chunks = ", v the model chunks per stage" if cls == "Interleaved" else ""
    message = (
        f"schedule={name!r} is gone; pass a schedule value: schedule=parallel.{value}, M its "
        f"micro-batches per step{chunks} (e.g. schedule=parallel.{cls}(8))."
    )
    with pytest.raises(TypeError, match=re.escape(f"pipeline_value_and_grad: {message}")):
        parallel.pipeline_value_and_grad(
            stage_fn, loss_fn, params, x, y, axis_name="stage", schedule=name
        )
    blocks = {"w": params["w"][None], "b": params["b"][None]}
    with pytest.raises(TypeError, match=re.escape(f"pipeline_loss: {message}")):
        parallel.pipeline_loss(  # refused in dense mode too
            stage_fn, lambda head, h, t: loss_fn(h, t), blocks, (), x, y, schedule=name
        )


@pytest.mark.parametrize("schedule", ["GPipe(8)", "", 1, parallel.GPipe])
def test_anything_but_a_schedule_value_is_refused(schedule):
    params, x, y = _problem(8)
    # The class itself is named as such, with the instance to pass.
    hint = (
        " (the class: pass an instance with its micro-batches, parallel.GPipe(8))"
        if schedule is parallel.GPipe
        else ""
    )
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"pipeline_value_and_grad: schedule must be a schedule value (parallel.GPipe(M), "
            f"parallel.OneFOneB(M), parallel.Interleaved(M, virtual=v) or "
            f"parallel.ZeroBubble(M)), got {schedule!r}{hint}."
        ),
    ):
        parallel.pipeline_value_and_grad(
            stage_fn, loss_fn, params, x, y, axis_name="stage", schedule=schedule
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_microbatches": 8},
        {"virtual_stages": 2},
        {"stage_axis": "stage"},
        {"data_axis": "data"},
    ],
    ids=str,
)
def test_the_old_keywords_are_gone(kwargs):
    params, x, y = _problem(8)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(kwargs))}'"):
        parallel.pipeline_value_and_grad(
            stage_fn, loss_fn, params, x, y, schedule=parallel.GPipe(2), **kwargs
        )
    assert not hasattr(parallel, "pipeline_apply") and not hasattr(parallel, "bubble_fraction")


def test_no_schedule_is_refused_and_the_stage_axis_defaults_to_the_role():
    params, x, y = _problem(8)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "pipeline_value_and_grad: no schedule is given, and no layout in force has one; "
            "pass schedule= (parallel.GPipe(M), "
        ),
    ):
        parallel.pipeline_value_and_grad(stage_fn, loss_fn, params, x, y, axis_name="stage")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pipeline_value_and_grad: axis_name='pipeline' is not a mesh axis bound here"
        ),
    ):
        parallel.pipeline_value_and_grad(
            stage_fn, loss_fn, params, x, y, schedule=parallel.GPipe(2)
        )
    # The role's default: the mesh axis named "pipeline" (no layout in force).
    mesh = mesh_1d(S, "pipeline")

    def body(p, x, y):
        mine = jax.tree.map(lambda v: v[0], p)
        loss, g = parallel.pipeline_value_and_grad(
            stage_fn, loss_fn, mine, x, y, schedule=parallel.OneFOneB(4)
        )
        return loss, jax.tree.map(lambda v: v[None], g)

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("pipeline"), P(), P()), out_specs=(P(), P("pipeline"))
        )
    )
    params, x, y = _problem(16)
    loss, grads = f(jax.device_put(params, NamedSharding(mesh, P("pipeline"))), x, y)
    _check_grads(loss, grads, params, x, y)
