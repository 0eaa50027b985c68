"""Side inputs of a pipeline (``side=``): per-token inputs every stage reads with its own
micro-batch. A model of PACKED sequences (2-3 sequences a row, attention within a sequence and
causal, positions restarting per sequence, padding masked by a float side input) pipelined
over 2 stages equals the same model on one device: the loss and every gradient of
``pipeline_loss`` (GPipe, 1F1B, ZB-H1) and ``pipeline_value_and_grad`` (interleaved), and 20
steps of SGD through ``dp.Trainer`` (1F1B, ZB-H1) against a jitted optax loop on the whole
batch. Interleaved layers passed without their ``(v, L // v, ...)`` reshape are refused by a
message that names it, where they used to fail deep in ``lax.scan``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcoll import dp, parallel

S, D, L = 2, 2, 4  # stages, data replicas, layers
T, W, V = 16, 16, 11  # tokens a row, width, vocabulary
ROWS = 8  # rows a replica


# ------------------------------------------------------------------ the model, as a user writes it
def block(h, p, seg, pos, keep):
    """One block on packed rows: a learned offset by position, attention within a sequence
    and causal (by position), padding zeroed."""
    h = h + p["pos"][pos]
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    allowed = (seg[:, :, None] == seg[:, None, :]) & (pos[:, :, None] >= pos[:, None, :])
    scores = jnp.where(allowed, q @ k.swapaxes(1, 2) / np.sqrt(W), -1e9)
    h = h + jax.nn.softmax(scores, axis=-1) @ v @ p["o"]
    return h * keep[..., None]


def stage(blocks, h, side):
    """Layers stacked on a leading axis, in order (a stage, or the whole model)."""

    def one(h, p):
        return block(h, p, side["seg"], side["pos"], side["keep"]), None

    return jax.lax.scan(one, h, blocks)[0]


def head(params, h, y):
    """The output head and the loss of a micro-batch: cross-entropy over real tokens."""
    targets, keep = y
    logp = jax.nn.log_softmax(h @ params["out"])
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll * keep)


def dense_loss(params, batch):
    """The model on one device, no jaxcoll: the embedding, every layer, the head."""
    h = stage(params["blocks"], params["emb"][batch["tokens"]], batch)
    return head(params["head"], h, (batch["y"], batch["keep"]))


def init_params(seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    return {
        "emb": normal(V, W, scale=0.5),
        "blocks": {
            "pos": normal(L, T, W, scale=0.1),
            "qkv": normal(L, W, 3 * W, scale=W**-0.5),
            "o": normal(L, W, W, scale=W**-0.5),
        },
        "head": {"out": normal(W, V, scale=0.3)},
    }


def packed_batch(rows, seed):
    """Rows of 2-3 sequences each, positions restarting per sequence, the tail padding (segment
    0, keep 0) in some rows."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, T), np.int32)
    pos = np.zeros((rows, T), np.int32)
    for r in range(rows):
        n = rng.integers(2, 4)
        used = T - rng.integers(0, 4)  # the rest is padding
        cuts = np.sort(rng.choice(np.arange(1, used), n - 1, replace=False))
        for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, used], strict=True)):
            seg[r, a:b] = i + 1
            pos[r, a:b] = np.arange(b - a)
    return {
        "tokens": rng.integers(0, V, size=(rows, T)).astype(np.int32),
        "y": rng.integers(0, V, size=(rows, T)).astype(np.int32),
        "seg": seg,
        "pos": pos,
        "keep": (seg > 0).astype(np.float32),
    }


def _close(got, want, rtol=1e-5, atol=1e-6):
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_packed_rows_hold_several_sequences():
    batch = packed_batch(ROWS, 0)
    for r in range(ROWS):
        real = batch["seg"][r][batch["seg"][r] > 0]
        assert 2 <= len(set(real)) <= 3
        starts = np.flatnonzero(np.diff(batch["seg"][r], prepend=-1) != 0)
        assert (batch["pos"][r][starts] == 0).all()


# ------------------------------------------------------------------ GPipe and interleaved
# (1F1B and ZB-H1 train in a Trainer below: the loss of every step and the params after 20.)
INTERLEAVED = parallel.Interleaved(4, virtual=2)


def _stage_blocks(blocks, v):
    """Layers in model order as the interleaved schedule holds them: ``(S, v, n, ...)``,
    stage s's chunk c being model chunk c*S + s."""
    return jax.tree.map(lambda t: t.reshape((v, S, -1) + t.shape[1:]).swapaxes(0, 1), blocks)


@pytest.fixture(scope="module")
def runs():
    """Pipelined over data 2 x stage 2, in one program: GPipe's loss and gradients by
    ``pipeline_loss`` (and its loss not differentiated: the forwards alone), the interleaved
    schedule's by ``pipeline_value_and_grad``; and the model's on one device."""
    params = init_params()
    batch = packed_batch(D * ROWS, 1)
    mesh = Mesh(np.array(jax.devices()[: D * S]).reshape(D, S), ("data", "stage"))
    specs = {"emb": P(), "blocks": jax.tree.map(lambda _: P("stage"), params["blocks"])}
    specs["head"] = {"out": P()}

    def body(params, staged_blocks, batch):
        side = {k: batch[k] for k in ("seg", "pos", "keep")}
        h = params["emb"][batch["tokens"]]
        y = (batch["y"], batch["keep"])

        def loss(params):
            value = parallel.pipeline_loss(
                stage,
                head,
                params["blocks"],
                params["head"],
                params["emb"][batch["tokens"]],
                y,
                axis_name="stage",
                schedule=parallel.GPipe(4),
                side=side,
            )
            return jax.lax.pmean(value, "data")

        # The step of one's own, interleaved: this stage's 2 chunks of one layer each.
        value, grads = parallel.pipeline_value_and_grad(
            stage,
            lambda out, y: head(params["head"], out, y),
            jax.tree.map(lambda t: t[0], staged_blocks),
            h,
            y,
            axis_name="stage",
            data_axis_name="data",
            schedule=INTERLEAVED,
            side=side,
        )
        interleaved = (value, jax.tree.map(lambda g: g[None], grads))
        return jax.value_and_grad(loss)(params), loss(params), interleaved

    staged_specs = jax.tree.map(lambda _: P("stage"), params["blocks"])
    out_specs = ((P(), specs), P(), (P(), staged_specs))
    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(specs, staged_specs, P("data")), out_specs=out_specs
        )
    )
    got = f(params, _stage_blocks(params["blocks"], INTERLEAVED.virtual), batch)
    return got, jax.jit(jax.value_and_grad(dense_loss))(params, batch), (params, batch)


def test_gpipe_with_side_inputs_equals_one_device(runs):
    ((loss, grads), loss_only, _), (want_loss, want), _ = runs
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(loss_only, want_loss, rtol=1e-5)
    _close(grads, want)


def test_interleaved_step_of_one_s_own_with_side_inputs_equals_one_device(runs):
    (_, _, (loss, grads)), (want_loss, want), _ = runs
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    v = INTERLEAVED.virtual
    in_order = jax.tree.map(lambda t: t.swapaxes(0, 1).reshape((L,) + t.shape[3:]), grads)
    assert jax.tree.leaves(grads)[0].shape[:3] == (S, v, L // (S * v))
    _close(in_order, want["blocks"])


def test_the_dense_mode_takes_the_whole_side_and_gives_floats_no_gradient(runs):
    _, (want_loss, want), (params, batch) = runs
    side = {k: batch[k] for k in ("seg", "pos", "keep")}

    def loss(params, keep):
        return parallel.pipeline_loss(
            stage,
            head,
            params["blocks"],
            params["head"],
            params["emb"][batch["tokens"]],
            (batch["y"], batch["keep"]),
            axis_name="stage",
            schedule=parallel.OneFOneB(4),
            side={**side, "keep": keep},
        )

    value, (grads, d_keep) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, side["keep"])
    np.testing.assert_allclose(value, want_loss, rtol=1e-6)
    _close(grads, want)
    assert not np.any(d_keep)  # a float side input is a constant


def test_a_side_input_without_a_row_per_example_is_named():
    params, batch = init_params(), packed_batch(ROWS, 3)
    with pytest.raises(
        ValueError,
        match=r"pipeline_loss: side\['pos'\] has 4 examples but x has 8; every stage is "
        r"handed micro-batch i of side",
    ):
        parallel.pipeline_loss(
            stage,
            head,
            params["blocks"],
            params["head"],
            params["emb"][batch["tokens"]],
            (batch["y"], batch["keep"]),
            schedule=parallel.GPipe(2),
            side={"seg": batch["seg"], "pos": batch["pos"][:4], "keep": batch["keep"]},
        )


# ------------------------------------------------------------------ 20 steps through a Trainer
STEPS, LR = 20, 0.05


def _batches():
    return [packed_batch(D * ROWS, 100 + i) for i in range(STEPS)]


def trainer_loss(params, batch, rng):
    side = {k: batch[k] for k in ("seg", "pos", "keep")}
    h = params["emb"][batch["tokens"]]
    y = (batch["y"], batch["keep"])
    value = parallel.pipeline_loss(stage, head, params["blocks"], params["head"], h, y, side=side)
    return value, {}


@pytest.fixture(scope="module")
def one_device():
    """20 steps of SGD on one device: a jitted optax loop on the whole batch."""
    opt = optax.sgd(LR)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(dense_loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.tree.map(jnp.asarray, init_params())
    opt_state, losses = opt.init(params), []
    for batch in _batches():
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize("schedule", [parallel.OneFOneB(4), parallel.ZeroBubble(4)], ids=repr)
def test_twenty_sgd_steps_in_a_trainer_equal_one_device(one_device, schedule):
    mesh = Mesh(np.array(jax.devices()[: D * S]).reshape(S, D), ("pipe", "data"))
    layout = dp.Layout(replicate="data", pipeline="pipe", schedule=schedule)
    trainer = dp.Trainer(trainer_loss, optax.sgd(LR), mesh=mesh, layout=layout)
    params = init_params()
    specs = jax.tree.map(lambda _: P(), params)
    specs["blocks"] = jax.tree.map(lambda _: P("layers"), params["blocks"])
    state = trainer.init(params, jax.random.key(0), specs=specs)
    losses = []
    for batch in _batches():
        state, metrics = trainer.step(state, batch)
        losses.append(metrics["loss"])
    losses = [float(x) for x in losses]
    want_params, want_losses = one_device
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _close(trainer.host_params(state), want_params, rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]  # it trained


# ------------------------------------------------------------------ interleaved: the reshape
def test_interleaved_layers_without_the_reshape_name_it():
    # Layers stacked (L, ...) with the spec P("layers"), run interleaved over 2 stages: each
    # stage holds 2 whole layers where 2 chunks (2, 1, ...) are expected. That used to fail
    # deep inside the stage (here a broadcast in the block; a scanned MLP's in lax.scan, see
    # below).
    mesh = Mesh(np.array(jax.devices()[: D * S]).reshape(S, D), ("pipe", "data"))
    layout = dp.Layout(replicate="data", pipeline="pipe", schedule=INTERLEAVED)
    trainer = dp.Trainer(trainer_loss, optax.sgd(LR), mesh=mesh, layout=layout)
    params = init_params()
    specs = jax.tree.map(lambda _: P(), params)
    specs["blocks"] = jax.tree.map(lambda _: P("layers"), params["blocks"])
    state = trainer.init(params, jax.random.key(0), specs=specs)
    with pytest.raises(
        ValueError,
        match=r"pipeline_loss: Interleaved\(virtual=2\) reads every leaf of stage_params as "
        r"this stage's 2 chunks stacked \(2, n, \.\.\.\).* here \(this stage's part, of 2 "
        r"stages\), and stage_fn fails on one chunk .*If these are layers, expected e\.g\. "
        r"params\['o'\] of shape \(2, 1, 16, 16\)\..*`blocks = jax\.tree\.map\(lambda t: "
        r"t\.reshape\(\(2, t\.shape\[0\] // 2\) \+ t\.shape\[1:\]\), blocks\)` and give them "
        r"P\(None, 'layers', \.\.\.\)",
    ) as excinfo:
        trainer.step(state, _batches()[0])
    assert excinfo.value.__cause__ is not None  # the stage's own error, chained


def test_interleaved_dense_mode_names_the_reshape():
    # One device, all 4 layers, Interleaved(v=4): the leading axis is v, but the layers were
    # not reshaped (4, 1, ...); without the check the dense mode merged the wrong axes.
    params, batch = init_params(), packed_batch(ROWS, 4)
    with pytest.raises(
        ValueError,
        match=r"pipeline_loss: Interleaved\(virtual=4\) reads every leaf of stage_params as "
        r"this stage's 4 chunks stacked \(4, n, \.\.\.\).*expected e\.g\. params\['o'\] of "
        r"shape \(4, 1, 16, 16\)",
    ):
        parallel.pipeline_loss(
            stage,
            head,
            params["blocks"],
            params["head"],
            params["emb"][batch["tokens"]],
            (batch["y"], batch["keep"]),
            axis_name="stage",
            schedule=parallel.Interleaved(4, virtual=4),
            side={k: batch[k] for k in ("seg", "pos", "keep")},
        )
    # A leading axis that is not v: the expected shape and the line, too.
    with pytest.raises(
        ValueError,
        match=r"params\['o'\] has shape \(4, 16, 16\), but Interleaved\(virtual=2\) needs "
        r"a leading axis of 2 .* expected \(2, \.\.\.\) \(e\.g\. \(2, 2, 16, 16\) if its 4 "
        r"leading entries are layers\)\. .*t\.reshape\(\(2, ",
    ):
        parallel.pipeline_loss(
            stage,
            head,
            params["blocks"],
            params["head"],
            params["emb"][batch["tokens"]],
            (batch["y"], batch["keep"]),
            axis_name="stage",
            schedule=parallel.Interleaved(4, virtual=2),
            side={k: batch[k] for k in ("seg", "pos", "keep")},
        )


def test_the_old_scan_failure_is_now_the_reshape_error():
    # The layers of a scanned MLP, 2 of them stacked (2, ...) and not reshaped (2, 1, ...):
    # read back "in order" they were merged into (16, 32), (64,), (64, 8), and lax.scan
    # refused them. Now the leading dims are checked first.
    rng = np.random.default_rng(0)
    blocks = {
        "a": rng.normal(size=(2, 8, 32)).astype(np.float32),
        "b": rng.normal(size=(2, 32)).astype(np.float32),
        "c": rng.normal(size=(2, 32, 8)).astype(np.float32),
    }

    def mlp_stage(p, h):
        return jax.lax.scan(lambda h, q: (h + jnp.tanh(h @ q["a"] + q["b"]) @ q["c"], None), h, p)[
            0
        ]

    x, y = np.ones((4, 8), np.float32), np.ones((4, 8), np.float32)
    merged = jax.tree.map(lambda t: t.reshape((-1,) + t.shape[2:]), blocks)
    with pytest.raises(ValueError, match="scan got values with different leading axis sizes"):
        mlp_stage(merged, x)  # what the dense mode used to run
    with pytest.raises(
        ValueError,
        match=r"pipeline_loss: Interleaved\(virtual=2\) reads every leaf of stage_params as "
        r"this stage's 2 chunks stacked \(2, n, \.\.\.\).*got params\['a'\]: \(2, 8, 32\), "
        r"params\['b'\]: \(2, 32\), params\['c'\]: \(2, 32, 8\), and their second dims are "
        r"no such n.*expected e\.g\. params\['a'\] of shape \(2, 1, 8, 32\)",
    ):
        parallel.pipeline_loss(
            mlp_stage,
            lambda _, h, y: jnp.mean((h - y) ** 2),
            blocks,
            (),
            x,
            y,
            axis_name="stage",
            schedule=parallel.Interleaved(2, virtual=2),
        )
