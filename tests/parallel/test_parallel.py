"""jaxcoll.parallel beyond what the examples prove (05/06/07 run in tests/test_examples.py):
the pipeline without a data axis and its loss (``pipeline_loss``), that loss differentiated
and run dense (no stage axis bound), MoE with a capacity that drops tokens, and every error."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll import parallel
from tests.helpers import mesh_1d

S, W = 4, 6


def stage_fn(p, h):
    return jnp.sin(h * p["a"] + p["b"])


def loss_fn(h, y):
    return jnp.mean((h - y) ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {
        "a": rng.normal(size=(S, W)).astype(np.float32),
        "b": rng.normal(size=(S, W)).astype(np.float32),
    }


def _reference(params, x):
    for s in range(S):
        x = stage_fn(jax.tree.map(lambda v, s=s: v[s], params), x)
    return x


def test_pipeline_without_data_axis_matches_one_device():
    mesh = mesh_1d(S, "stage")
    params = _params()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, W)).astype(np.float32)
    y = rng.normal(size=(12, W)).astype(np.float32)

    def body(p, x, y):
        mine = jax.tree.map(lambda v: v[0], p)
        loss, g = parallel.pipeline_value_and_grad(
            stage_fn, loss_fn, mine, x, y, axis_name="stage", schedule=parallel.GPipe(3)
        )
        # The same schedules' loss alone (not differentiated: the forwards only).
        value = parallel.pipeline_loss(
            stage_fn, _headless, mine, (), x, y, axis_name="stage", schedule=parallel.GPipe(4)
        )
        return loss, jax.tree.map(lambda v: v[None], g), value

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("stage"), P(), P()), out_specs=(P(), P("stage"), P())
        )
    )
    loss, grads, value = f(jax.device_put(params, NamedSharding(mesh, P("stage"))), x, y)
    want_loss, want_grads = jax.value_and_grad(lambda p: loss_fn(_reference(p, x), y))(params)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(value, want_loss, rtol=1e-6)


def _headless(head, h, y):
    """``loss_fn`` as ``pipeline_loss`` calls a head: ``(head params, h, y)``, here none."""
    return loss_fn(h, y)


LAYERS = 2  # per stage: one model, S * LAYERS layers stacked on a leading axis


def _layers():
    rng = np.random.default_rng(3)
    return {
        "a": rng.normal(size=(S * LAYERS, W)).astype(np.float32),
        "b": rng.normal(size=(S * LAYERS, W)).astype(np.float32),
    }


def layers_fn(p, h):
    """Every layer of ``p`` in order: a stage's own layers, or the whole model's (dense)."""
    return jax.lax.scan(lambda h, layer: (stage_fn(layer, h), None), h, p)[0]


def model_loss(p, x, y):
    """The model's loss by GPipe over 4 micro-batches: pipelined where "stage" is bound (``p``
    this stage's layers), the dense model where not (``p`` every layer)."""
    return parallel.pipeline_loss(
        layers_fn, _headless, p, (), x, y, axis_name="stage", schedule=parallel.GPipe(4)
    )


def test_pipeline_loss_is_the_dense_model_where_the_stage_axis_is_unbound():
    params = _layers()
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, W)).astype(np.float32)
    y = rng.normal(size=(8, W)).astype(np.float32)
    h = x
    for k in range(S * LAYERS):
        h = stage_fn(jax.tree.map(lambda v, k=k: v[k], params), h)
    want = loss_fn(h, y)
    np.testing.assert_allclose(model_loss(params, x, y), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.jit(model_loss)(params, x, y), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(
        ValueError,
        match=r"pipeline_loss: the batch has 8 examples, which do not split into the 3 of "
        r"GPipe\(microbatches=3\)",
    ):
        parallel.pipeline_loss(
            layers_fn, _headless, params, (), x, y, axis_name="stage", schedule=parallel.GPipe(3)
        )


def test_pipeline_loss_refuses_a_stage_axis_bound_in_part():
    mesh = mesh_1d(S, "stage")

    def body(p, x):
        return parallel.pipeline_loss(
            layers_fn,
            _headless,
            p,
            (),
            x,
            x,
            axis_name=("stage", "other"),
            schedule=parallel.GPipe(4),
        )

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P()))
    with pytest.raises(
        ValueError,
        match=r"pipeline_loss: axis_name=\('stage', 'other'\) is bound only in part "
        r"\(\['other'\] not bound here\)",
    ):
        f.trace(_layers(), jax.ShapeDtypeStruct((8, W), jnp.float32))


def test_grad_through_pipeline_loss_equals_the_dense_gradient():
    # The same loss function, inside shard_map over 4 stages (each holding its 2 layers) and
    # outside it (dense, all 8 layers): jax.grad must agree, for the params (varying over the
    # stages) and for the input (invariant: its gradient is summed over the stages once).
    mesh = mesh_1d(S, "stage")
    params = _layers()
    rng = np.random.default_rng(5)
    x = rng.normal(size=(8, W)).astype(np.float32)
    y = rng.normal(size=(8, W)).astype(np.float32)
    grad = jax.grad(model_loss, argnums=(0, 1))
    f = jax.jit(
        jax.shard_map(
            lambda p, x, y: (model_loss(p, x, y), *grad(p, x, y)),
            mesh=mesh,
            in_specs=(P("stage"), P(), P()),
            out_specs=(P(), P("stage"), P()),
        )
    )
    loss, g_params, g_x = f(jax.device_put(params, NamedSharding(mesh, P("stage"))), x, y)
    want_params, want_x = grad(params, x, y)
    np.testing.assert_allclose(loss, model_loss(params, x, y), rtol=0, atol=1e-5)
    for k in params:
        np.testing.assert_allclose(g_params[k], want_params[k], rtol=0, atol=1e-5)
    np.testing.assert_allclose(g_x, want_x, rtol=0, atol=1e-5)


def test_bubble_fraction():
    assert parallel.GPipe(8).bubble_fraction(4) == 3 / 11
    assert parallel.GPipe(5).bubble_fraction(1) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"schedule": parallel.GPipe(5)},
            r"pipeline_value_and_grad: the batch has 12 examples, which do "
            r"not split into the 5 of GPipe\(microbatches=5\) equal micro-batches",
        ),
        (
            {"schedule": parallel.OneFOneB(8)},
            r"the batch has 12 examples, which do not split into the 8 of "
            r"OneFOneB\(microbatches=8\) equal micro-batches\. Pick a divisor of the "
            r"per-replica batch size\.",
        ),
        (
            {"stage_fn": lambda p, h: h[:, :2]},
            r"stage_fn maps a micro-batch of shape \(4, 6\) "
            r"float32 to \(4, 2\) float32",
        ),
    ],
)
def test_pipeline_errors(kwargs, match):
    mesh = mesh_1d(S, "stage")
    args = {"stage_fn": stage_fn, "schedule": parallel.GPipe(3), **kwargs}

    def body(p, x):
        mine = jax.tree.map(lambda v: v[0], p)
        return parallel.pipeline_value_and_grad(
            args["stage_fn"],
            loss_fn,
            mine,
            x,
            x,
            axis_name="stage",
            schedule=args["schedule"],
        )[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P()))
    with pytest.raises(ValueError, match=match):
        f.trace(_params(), jax.ShapeDtypeStruct((12, W), jnp.float32))


@pytest.mark.parametrize(
    "y, match",
    [
        (
            jax.ShapeDtypeStruct((4, W), jnp.float32),
            r"pipeline_value_and_grad: y has 4 examples "
            r"but x has 12; .*one target per example of "
            r"x.*a leading axis of 12",
        ),
        (jax.ShapeDtypeStruct((24, W), jnp.float32), r"y has 24 examples but x has 12"),
        (
            {
                "h": jax.ShapeDtypeStruct((12, W), jnp.float32),
                "w": jax.ShapeDtypeStruct((), jnp.float32),
            },
            r"y\['w'\] has no leading axis \(a scalar\) but x has 12",
        ),
    ],
)
def test_pipeline_refuses_targets_that_do_not_match_the_examples(y, match):
    # 4 targets for 12 examples split into 4 micro-batches of 3 and 1: loss_fn would
    # broadcast them and return a loss of the wrong pairs.
    mesh = mesh_1d(S, "stage")

    def body(p, x, y):
        mine = jax.tree.map(lambda v: v[0], p)
        loss_of = loss_fn if not isinstance(y, dict) else lambda h, t: loss_fn(h, t["h"])
        return parallel.pipeline_value_and_grad(
            stage_fn, loss_of, mine, x, y, axis_name="stage", schedule=parallel.GPipe(4)
        )[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P(), P()), out_specs=P()))
    with pytest.raises(ValueError, match=match):
        f.trace(_params(), jax.ShapeDtypeStruct((12, W), jnp.float32), y)


def test_moe_capacity_drops_come_back_as_zeros():
    n, t, d = 4, 8, 3
    mesh = mesh_1d(n, "ep")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(n, t, d)).astype(np.float32)
    expert = rng.integers(0, n, (n, t)).astype(np.int32)
    expert[:, :4] = 0  # every rank sends >= 4 tokens to rank 0, which takes only 6

    def body(x, e):
        got, local, valid, routing = parallel.dispatch(
            x[0], e[0], "ep", experts_per_rank=1, capacity=6
        )
        y = jnp.where(valid[:, None], got * 10.0, 0.0)  # the "expert": times ten
        return parallel.combine(y, routing, "ep")[None], routing.recv_sizes[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    out, recv = f(x, expert)
    out, recv = np.asarray(out), np.asarray(recv)
    assert recv[0].sum() == 6 and recv[0].tolist()[:2] == [4, 2]  # rank 0 kept 6 rows
    for r in range(n):
        kept = set()  # receiver q keeps a prefix of each sender's rows: recv[q][r] of r's
        for q in range(n):
            kept |= set(np.flatnonzero(expert[r] == q)[: recv[q][r]].tolist())
        for i in range(t):
            np.testing.assert_allclose(
                out[r, i],
                10 * x[r, i] if i in kept else 0.0,
                rtol=1e-6,
                err_msg=f"rank {r} token {i}",
            )
    assert (out == 0).all(axis=-1).sum() > 0


def test_mlp_specs_split_the_whole_params_as_the_layers_boxes_do():
    whole = {"w1": np.zeros((2, 8)), "b1": np.zeros(8), "w2": np.zeros((8, 2)), "b2": np.zeros(2)}
    assert parallel.mlp_specs(whole) == {
        "w1": P(None, "tensor"),
        "b1": P("tensor"),
        "w2": P("tensor", None),
        "b2": P(),
    }
    assert parallel.mlp_specs({"w1": whole["w1"], "w2": whole["w2"]}, "mlp") == {
        "w1": P(None, "mlp"),
        "w2": P("mlp", None),
    }
    with pytest.raises(ValueError, match=r"parallel\.mlp_specs: params must hold 'w1' and 'w2'"):
        parallel.mlp_specs({"w1": whole["w1"], "w3": whole["w2"]})


def test_tensor_parallel_functions_are_dense_where_the_axis_is_not_bound():
    # The same calls outside shard_map (or over a mesh without the axis): the whole params,
    # the dense block, no collective; sequence_parallel does nothing there.
    rng = np.random.default_rng(5)
    p = {
        "w1": rng.normal(size=(8, 16)).astype(np.float32),
        "b1": rng.normal(size=(16,)).astype(np.float32),
        "w2": rng.normal(size=(16, 8)).astype(np.float32),
        "b2": rng.normal(size=(8,)).astype(np.float32),
    }
    x = rng.normal(size=(6, 8)).astype(np.float32)
    want = parallel.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    for sp in (False, True):
        np.testing.assert_allclose(
            np.asarray(parallel.mlp(p, x, "tensor", sequence_parallel=sp)), want, rtol=1e-6
        )
    assert parallel.sequence_gather(x, "tensor", dim=-2) is x
    np.testing.assert_allclose(
        np.asarray(parallel.row_parallel(x, p["w1"], None, p["b1"], scatter=True)),
        x @ p["w1"] + p["b1"],
        rtol=1e-6,
    )
    f = jax.jit(
        jax.shard_map(
            lambda p, x: parallel.mlp(p, x),
            mesh=mesh_1d(2, "data"),
            in_specs=(P(), P("data")),
            out_specs=P("data"),
        )
    )
    lowered = f.lower(p, x)
    assert "all_reduce" not in lowered.as_text()
    np.testing.assert_allclose(np.asarray(lowered.compile()(p, x)), want, rtol=1e-5, atol=1e-5)


def test_gelu_is_torchs_exact_gelu():
    # torch's nn.GELU() is x * Phi(x) with the erf; jax.nn.gelu's default is the tanh form.
    x = np.linspace(-3, 3, 601).astype(np.float32)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    np.testing.assert_allclose(np.asarray(parallel.gelu(x)), want, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(jax.nn.gelu(x)) - want).max() > 1e-4  # the tanh form is not it


def test_mlp_without_biases_and_with_the_exact_gelu_equals_the_dense_block():
    # nanoGPT's MLP: nn.Linear(..., bias=False) and nn.GELU(); 4-way tensor parallel.
    n, d, f, t = 4, 8, 16, 6
    rng = np.random.default_rng(3)
    w1 = rng.normal(size=(d, f)).astype(np.float32)
    w2 = rng.normal(size=(f, d)).astype(np.float32) / 4
    x = rng.normal(size=(t, d)).astype(np.float32)
    h = x.astype(np.float64) @ w1
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))
    want = gelu(h) @ w2
    whole = {"w1": w1, "w2": w2}  # the params whole; each device is handed its slices
    specs = parallel.mlp_specs(whole, "model")
    assert specs == {"w1": P(None, "model"), "w2": P("model", None)}
    mesh = mesh_1d(n, "model")

    def body(p, x):
        assert p["w1"].shape == (d, f // n) and p["w2"].shape == (f // n, d)  # the slices
        return parallel.mlp(p, x, "model")

    placed = jax.device_put(whole, {k: NamedSharding(mesh, s) for k, s in specs.items()})
    y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P()))(placed, x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"parallel\.mlp: params must hold 'w1' and 'w2'"):
        jax.jit(
            jax.shard_map(
                lambda p, x: parallel.mlp(p, x, "model"),
                mesh=mesh,
                in_specs=({"w1": specs["w1"]}, P()),
                out_specs=P(),
            )
        )({"w1": placed["w1"]}, x)


def test_sequence_parallel_backward_reduce_scatters_the_input_cotangent():
    # parallel.mlp(sequence_parallel=True) under jax.grad: forward one all-gather and one
    # reduce-scatter; the backward mirrors them (its gather's transpose is a reduce-scatter,
    # not an all-reduce of the whole gathered cotangent), and the gradient is the dense one.
    from tests.nn.test_tensor_layers import _counts

    n, d, f, t = 4, 8, 16, 8
    rng = np.random.default_rng(4)
    dense = {
        "w1": rng.normal(size=(d, f)).astype(np.float32) / 3,
        "w2": rng.normal(size=(f, d)).astype(np.float32) / 4,
    }
    x = rng.normal(size=(t, d)).astype(np.float32)
    mesh = mesh_1d(n, "model")
    specs = parallel.mlp_specs(dense, "model")
    placed = jax.device_put(dense, {k: NamedSharding(mesh, s) for k, s in specs.items()})

    def body(p, x_rows):
        def loss(x_rows):
            y = parallel.mlp(p, x_rows, "model", sequence_parallel=True)
            return jnp.sum(y**2)

        return jax.grad(loss)(x_rows)

    f_ = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("model")), out_specs=P("model")))
    counts = _counts(f_.lower(placed, x).as_text())
    assert counts == {"all_gather": 2, "reduce_scatter": 2}, counts
    want = jax.grad(lambda x: jnp.sum((parallel.gelu(x @ dense["w1"]) @ dense["w2"]) ** 2))(x)
    np.testing.assert_allclose(np.asarray(f_(placed, x)), want, rtol=1e-4, atol=1e-4)
