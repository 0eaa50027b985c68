"""``parallel.pipeline_loss``: a schedule behind ``jax.custom_vjp``, inside a loss that
``jax.grad`` differentiates (an embedding before it, a head with params after it, a data axis
beside it). Every schedule's loss and gradients (the embedding's, the stages', the head's)
equal the dense model's on one device, and so does its loss not differentiated (the forwards
alone); the dense mode is that model; in a ``dp.Trainer`` step
1F1B keeps a fraction of the memory GPipe's forward differentiated by jax does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcoll import dp, parallel, primitives
from jaxcoll.parallel._stages import _forward

S, V, D, W, E = 4, 2, 2, 8, 3  # stages, chunks per stage (interleaved), replicas, width, input


def stage_fn(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def chunks_fn(p, h):
    """Several layers stacked on a leading axis, in order (a stage, or the dense model)."""
    return jax.lax.scan(lambda h, q: (stage_fn(q, h), None), h, p)[0]


def head_fn(head, h, y):
    """The head's params and a pytree of targets: a weighted squared error (a mean)."""
    return jnp.mean(y["weight"][:, None] * (h @ head["out"] - y["target"]) ** 2)


def _problem(layers, batch=16 * D):
    rng = np.random.default_rng(layers)
    params = {
        "emb": (rng.normal(size=(E, W)) * 0.5).astype(np.float32),
        "blocks": {
            "w": (rng.normal(size=(layers, W, W)) / np.sqrt(W)).astype(np.float32),
            "b": (rng.normal(size=(layers, W)) * 0.1).astype(np.float32),
        },
        "head": {"out": (rng.normal(size=(W, 2)) * 0.5).astype(np.float32)},
    }
    x = rng.normal(size=(batch, E)).astype(np.float32)
    y = {
        "target": rng.normal(size=(batch, 2)).astype(np.float32),
        "weight": rng.uniform(0.5, 1.5, size=batch).astype(np.float32),
    }
    return params, x, y


def _dense_loss(params, x, y):
    return head_fn(params["head"], chunks_fn(params["blocks"], x @ params["emb"]), y)


def _interleaved_order(blocks, stages, v):
    """Layers (S*v of them, in model order) as the interleaved schedule holds them: stage s's
    chunks s, s + S, ... stacked, then the stages: shape (S, v, ...)."""
    return jax.tree.map(lambda t: t.reshape((v, stages) + t.shape[1:]).swapaxes(0, 1), blocks)


SCHEDULES = [
    parallel.GPipe(4),
    parallel.OneFOneB(4),
    parallel.Interleaved(4, virtual=1),
    parallel.Interleaved(4, virtual=V),
    parallel.ZeroBubble(4),
    parallel.ZeroBubble(2),  # fewer micro-batches than stages
]


@pytest.fixture(scope="module")
def runs():
    """Each schedule's (loss, grads) and the dense model's, on a data x stage mesh: one
    compiled program for the four schedules."""
    mesh = Mesh(np.array(jax.devices()[: D * S]).reshape(D, S), ("data", "stage"))
    problems = [_problem(S * schedule.virtual) for schedule in SCHEDULES]

    def body(*args):
        out = []
        for schedule, (params, x, y) in zip(SCHEDULES, zip(*[iter(args)] * 3), strict=True):

            def loss(params, schedule=schedule, x=x, y=y):
                h = x @ params["emb"]
                blocks = jax.tree.map(lambda t: t[0], params["blocks"])  # this stage's
                value = parallel.pipeline_loss(
                    chunks_fn if isinstance(schedule, parallel.Interleaved) else stage_fn,
                    head_fn,
                    blocks,
                    params["head"],
                    h,
                    y,
                    axis_name="stage",
                    schedule=schedule,
                )
                return jax.lax.pmean(value, "data")

            # Differentiated (the schedule's own backward), and not (the forwards alone).
            out.append((jax.value_and_grad(loss)(params), loss(params)))
        return tuple(out)

    args, in_specs, out_specs = [], [], []
    for schedule, (params, x, y) in zip(SCHEDULES, problems, strict=True):
        if isinstance(schedule, parallel.Interleaved):
            # (S, v, 1, ...): stage s's v chunks of one layer each, in the schedule's order.
            blocks = _interleaved_order(params["blocks"], S, schedule.virtual)
            blocks = jax.tree.map(lambda t: t[:, :, None], blocks)
        else:
            blocks = params["blocks"]
        placed = {**params, "blocks": blocks}
        specs = {"emb": P(), "blocks": {"w": P("stage"), "b": P("stage")}, "head": {"out": P()}}
        args += [placed, x, y]
        in_specs += [specs, P("data"), P("data")]
        out_specs.append(((P(), specs), P()))
    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=tuple(out_specs))
    )
    got = f(*args)
    want = [jax.value_and_grad(_dense_loss)(p, x, y) for p, x, y in problems]
    return got, want


@pytest.mark.parametrize("k", range(len(SCHEDULES)), ids=[repr(s) for s in SCHEDULES])
def test_every_schedule_equals_the_dense_model(runs, k):
    ((loss, grads), loss_only), (want_loss, want) = runs[0][k], runs[1][k]
    schedule = SCHEDULES[k]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(loss_only, want_loss, rtol=1e-6)
    blocks = grads["blocks"]
    if isinstance(schedule, parallel.Interleaved):  # back to model order
        blocks = jax.tree.map(
            lambda t: t[:, :, 0].swapaxes(0, 1).reshape((-1,) + t.shape[3:]), blocks
        )
    np.testing.assert_allclose(grads["emb"], want["emb"], rtol=1e-5, atol=1e-7)  # stage 0's
    np.testing.assert_allclose(grads["head"]["out"], want["head"]["out"], rtol=1e-5, atol=1e-7)
    for name in ("w", "b"):
        np.testing.assert_allclose(blocks[name], want["blocks"][name], rtol=1e-5, atol=1e-7)


def test_targets_in_a_tuple_and_integer_labels():
    # A tuple of targets, one of them integers (no cotangent: float0), under 1F1B and
    # accumulated over a scan (the Trainer's accumulation closes over no tracer).
    params, x, _ = _problem(S)
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, size=x.shape[0]).astype(np.int32)
    weight = rng.uniform(0.5, 1.5, size=x.shape[0]).astype(np.float32)

    def head(head, h, y):
        labels, weight = y
        logp = jax.nn.log_softmax(h @ head["out"])
        return -jnp.mean(weight * jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0])

    def loss(params, x, y, schedule):
        h = x @ params["emb"]
        blocks = (
            params["blocks"] if schedule is None else jax.tree.map(lambda t: t[0], params["blocks"])
        )
        return parallel.pipeline_loss(
            stage_fn if schedule is not None else chunks_fn,
            head,
            blocks,
            params["head"],
            h,
            y,
            axis_name="stage",
            schedule=schedule or parallel.OneFOneB(4),
        )

    mesh = Mesh(np.array(jax.devices()[:S]), ("stage",))
    specs = {"emb": P(), "blocks": {"w": P("stage"), "b": P("stage")}, "head": {"out": P()}}

    def body(params, x, y):
        def two_halves(total, k):  # accumulation over a scan, as the Trainer's
            part = jax.tree.map(lambda t: t.reshape((2, -1) + t.shape[1:])[k], (x, y))
            return total + loss(params, *part, parallel.OneFOneB(4)) / 2, None

        value = jax.lax.scan(two_halves, jnp.float32(0), jnp.arange(2))[0]
        return value

    f = jax.jit(
        jax.shard_map(
            jax.value_and_grad(body), mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs)
        )
    )
    got_loss, got = f(params, x, (labels, weight))

    def dense(params):
        halves = [
            loss(
                params,
                x.reshape(2, -1, x.shape[1])[k],
                (labels.reshape(2, -1)[k], weight.reshape(2, -1)[k]),
                None,
            )
            for k in range(2)
        ]
        return (halves[0] + halves[1]) / 2

    want_loss, want = jax.value_and_grad(dense)(params)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_dense_mode_is_the_dense_model():
    params, x, y = _problem(S)

    def loss(params):
        h = x @ params["emb"]
        return parallel.pipeline_loss(
            chunks_fn,
            head_fn,
            params["blocks"],
            params["head"],
            h,
            y,
            axis_name="stage",
            schedule=parallel.OneFOneB(4),
        )

    got_loss, got = jax.value_and_grad(loss)(params)
    want_loss, want = jax.value_and_grad(_dense_loss)(params, x, y)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "schedule, error, match",
    [
        ("1f1b", TypeError, r"pipeline_loss: schedule='1f1b' is gone; .*parallel\.OneFOneB\(M\)"),
        (4, TypeError, r"pipeline_loss: schedule must be a schedule value .* got 4"),
        (
            parallel.GPipe(5),
            ValueError,
            r"pipeline_loss: the batch has 8 examples, which do not split into the 5 of "
            r"GPipe\(microbatches=5\) equal micro-batches",
        ),
    ],
)
def test_bad_schedules_are_named(schedule, error, match):
    params, x, y = _problem(S, batch=8)
    with pytest.raises(error, match=match):
        parallel.pipeline_loss(
            chunks_fn,
            head_fn,
            params["blocks"],
            params["head"],
            x @ params["emb"],
            y,
            axis_name="stage",
            schedule=schedule,
        )


def test_zb_h1_in_a_step_of_your_own_equals_the_dense_model():
    # pipeline_value_and_grad (the step is the caller's) with ZB-H1 and a data axis: the loss
    # and the stages' gradient, averaged over the replicas once.
    params, x, y = _problem(S)
    mesh = Mesh(np.array(jax.devices()[: D * S]).reshape(D, S), ("data", "stage"))

    def body(blocks, h, y):
        loss, grads = parallel.pipeline_value_and_grad(
            stage_fn,
            lambda out, y: head_fn(params["head"], out, y),
            jax.tree.map(lambda t: t[0], blocks),
            h,
            y,
            axis_name="stage",
            data_axis_name="data",
            schedule=parallel.ZeroBubble(4),
        )
        return loss, jax.tree.map(lambda g: g[None], grads)

    specs = {"w": P("stage"), "b": P("stage")}
    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=(P(), specs)
        )
    )
    h = x @ params["emb"]
    loss, grads = f(params["blocks"], h, y)
    want_loss, want = jax.value_and_grad(lambda b: head_fn(params["head"], chunks_fn(b, h), y))(
        params["blocks"]
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for name in ("w", "b"):
        np.testing.assert_allclose(grads[name], want[name], rtol=1e-5, atol=1e-7)


def test_zb_h1_idles_a_third_of_1f1b_and_keeps_what_1f1b_s_first_stage_does():
    """At 4 stages x 8 micro-batches, in units of one forward (B and W each as long, 1F1B's
    backward both at once): 1F1B's stage idles 3(S - 1) = 9 units, ZB-H1's S - 1 = 3."""
    zb = parallel.ZeroBubble(8)
    rows = zb.table(4)
    assert [len(row) for row in rows] == [3 * 8 + 3] * 4  # 3M + S - 1 slots
    idle = [sum(op is None for op in row) for row in rows]
    one_f_one_b_idle = 3 * (4 - 1)
    assert max(idle) * 3 <= one_f_one_b_idle, idle
    assert zb.bubble_fraction(4) == 3 / 27
    # Every stage runs each micro-batch's F, B and W once, F before B before W.
    for row in rows:
        ops = [op for op in row if op is not None]
        assert sorted(ops) == sorted((k, i) for k in "FBW" for i in range(8))
        for i in range(8):
            assert ops.index(("F", i)) < ops.index(("B", i)) < ops.index(("W", i))
    # As many stage inputs as 1F1B's first stage keeps.
    assert zb.kept_inputs(4) == parallel.OneFOneB(8).kept_inputs(4) == 4
    # Stage 0's order: 3 warm-up forwards, then F, B, W, then B, W.
    assert [op for op in rows[0] if op is not None][:7] == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("F", 3),
        ("B", 0),
        ("W", 0),
        ("F", 4),
    ]


def test_the_base_class_is_not_a_schedule():
    with pytest.raises(TypeError, match=r"Schedule: not a schedule the pipeline lowers; use"):
        parallel.Schedule(8)


# ------------------------------------------------------------------ inside a dp.Trainer
L, M, ROWS, WIDTH = 8, 16, 1024, 128  # layers, micro-batches, rows a replica, width


def _block(h, w):
    return h + jnp.tanh(h @ w["a"]) @ w["b"], None


def _stage(ws, h):
    return jax.lax.scan(_block, h, ws)[0]


def _mse(head, h, y):
    return jnp.mean((h @ head["out"] - y) ** 2)


def _temp_mib(loss_fn):
    """The temp bytes (MiB) of a Trainer step's compiled program on data 2 x pipeline 4."""
    rng = np.random.default_rng(0)
    params = {
        "inp": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) * 0.05,
        "blocks": {
            "a": rng.normal(size=(L, WIDTH, 4 * WIDTH)).astype(np.float32) * 0.05,
            "b": rng.normal(size=(L, 4 * WIDTH, WIDTH)).astype(np.float32) * 0.05,
        },
        "out": rng.normal(size=(WIDTH, 4)).astype(np.float32) * 0.05,
    }
    specs = {"inp": P(), "blocks": {"a": P("pipe"), "b": P("pipe")}, "out": P()}
    batch = {
        "x": np.ones((2 * ROWS, WIDTH), np.float32),
        "y": np.ones((2 * ROWS, 4), np.float32),
    }
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, S), ("data", "pipe"))
    layout = dp.Layout(replicate="data", pipeline="pipe")
    trainer = dp.Trainer(loss_fn, optax.sgd(0.1), mesh=mesh, layout=layout)
    state = trainer.init(params, jax.random.key(0), specs=specs)
    step, args = trainer.step_program(state, batch)
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def _autodiff_gpipe(stage_fn, params, h):
    """GPipe's forward over the ``pipe`` axis, every stage given the last one's output, for
    jax to differentiate: the baseline a schedule's own backward is measured against."""
    _, outs = _forward("autodiff GPipe", stage_fn, params, h.reshape((M, -1, h.shape[1])), "pipe")
    return primitives.broadcast(outs.reshape(h.shape), "pipe", S - 1)


def test_in_a_trainer_1f1b_keeps_under_half_of_gpipe_by_autodiff():
    """4 stages x 16 micro-batches, a 2-layer MLP (4x hidden) per stage: the autodiff GPipe
    keeps every micro-batch's hidden activations, 1F1B S stage inputs."""

    def autodiff(params, batch, rng):
        h = _autodiff_gpipe(_stage, params["blocks"], batch["x"] @ params["inp"])
        return _mse(params, h, batch["y"]), {}

    def one_f_one_b(params, batch, rng):
        h = batch["x"] @ params["inp"]
        loss = parallel.pipeline_loss(
            _stage,
            _mse,
            params["blocks"],
            {"out": params["out"]},
            h,
            batch["y"],
            axis_name="pipe",
            schedule=parallel.OneFOneB(M),
        )
        return loss, {}

    gpipe, ofob = _temp_mib(autodiff), _temp_mib(one_f_one_b)
    assert ofob <= 0.5 * gpipe, (ofob, gpipe)


@pytest.mark.parametrize(
    "schedule",
    [
        parallel.GPipe(4),
        parallel.OneFOneB(4),
        parallel.Interleaved(4, virtual=V),
        parallel.ZeroBubble(4),
    ],
    ids=repr,
)
def test_the_head_runs_on_the_last_stage_alone(schedule):
    # Each stage that runs the head says so (a callback inside it): only the last stage does,
    # differentiated (the schedule's own backward) and not (an evaluation); the others skip
    # its FLOPs (a branch of their own), not merely its result.
    seen = set()
    mesh = Mesh(np.array(jax.devices()[:S]), ("stage",))
    params, x, y = _problem(S * schedule.virtual, batch=16)

    def counted_head(head, h, y):
        jax.debug.callback(lambda s: seen.add(int(s)), jax.lax.axis_index("stage"))
        return head_fn(head, h, y)

    def loss(params, x, y):
        blocks = jax.tree.map(lambda t: t[0], params["blocks"])
        interleaved = isinstance(schedule, parallel.Interleaved)
        return parallel.pipeline_loss(
            chunks_fn if interleaved else stage_fn,
            counted_head,
            blocks,
            params["head"],
            x @ params["emb"],
            y,
            axis_name="stage",
            schedule=schedule,
        )

    blocks = params["blocks"]
    if isinstance(schedule, parallel.Interleaved):
        blocks = jax.tree.map(lambda t: t[:, :, None], _interleaved_order(blocks, S, V))
    params = {**params, "blocks": blocks}
    specs = {"emb": P(), "blocks": {"w": P("stage"), "b": P("stage")}, "head": {"out": P()}}
    for fn in (jax.grad(loss), loss):
        seen.clear()
        f = jax.shard_map(fn, mesh=mesh, in_specs=(specs, P(), P()), out_specs=specs)
        if fn is loss:
            f = jax.shard_map(fn, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P())
        jax.block_until_ready(jax.jit(f)(params, x, y))
        assert seen == {S - 1}, (schedule, fn, seen)
