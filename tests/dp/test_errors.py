"""User mistakes get a clear error that names the op, the argument, the value and the fix:
never a segfault, a raw Python error from inside the step, or a silently wrong model."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxcoll import dp
from tests.helpers import mesh_1d

BATCH = {"x": np.ones((16, 3), np.float32), "y": np.zeros(16, np.int32)}
W = {"w": np.zeros((3, 4), np.float32)}


def _logits(w, batch):
    return batch["x"] @ w["w"]


def _ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _trainer(loss_fn, **kw):
    trainer = dp.Trainer(loss_fn, optax.sgd(0.1), mesh=mesh_1d(8, "data"), **kw)
    return trainer, trainer.init(W, jax.random.key(0))


def test_a_donated_state_used_again_raises_instead_of_crashing(tmp_path):
    trainer, old = _trainer(lambda w, b, rng: (_ce(_logits(w, b), b), {}))
    new, _ = trainer.step(old, BATCH)
    assert any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(old))
    for api, call in [
        ("Trainer.step", lambda: trainer.step(old, BATCH)),
        ("Trainer.evaluate", lambda: trainer.evaluate(old, [BATCH])),
        ("Trainer.fit", lambda: trainer.fit(old, [BATCH], steps=2)),
    ]:
        with pytest.raises(
            ValueError,
            match=rf"{api}: the state passed was donated to an "
            rf"earlier Trainer.step.*donate=False",
        ):
            call()
    new, _ = trainer.step(new, BATCH)  # the returned state is the one to use
    keep, state = _trainer(lambda w, b, rng: (_ce(_logits(w, b), b), {}), donate=False)
    after, _ = keep.step(state, BATCH)
    keep.step(state, BATCH)  # donate=False: old states stay alive


BAD_RETURNS = {
    "bare scalar": (
        lambda w, b, rng: _ce(_logits(w, b), b),
        TypeError,
        r"a bare loss \(a 0-d array.*return \(loss, metrics\)",
    ),
    "None": (lambda w, b, rng: None, TypeError, r"None instead of \(loss, metrics\)"),
    "str metric": (
        lambda w, b, rng: (_ce(_logits(w, b), b), {"note": "hi"}),
        TypeError,
        r"metric 'note' as a str; metrics must be numeric scalars",
    ),
    "per-example metric": (
        lambda w, b, rng: (_ce(_logits(w, b), b), {"logits": _logits(w, b)}),
        ValueError,
        r"metric 'logits' of shape \(2, 4\); metrics must be "
        r"scalars.*jnp.mean",
    ),
    "per-example loss": (
        lambda w, b, rng: (
            optax.softmax_cross_entropy_with_integer_labels(_logits(w, b), b["y"]),
            {},
        ),
        ValueError,
        r"a loss of shape \(2,\); the loss must be a "
        r"scalar",
    ),
    "int loss": (lambda w, b, rng: (jnp.sum(b["y"]), {}), TypeError, r"a loss of dtype int32"),
    "metric named loss": (
        lambda w, b, rng: (_ce(_logits(w, b), b), {"loss": 1.0}),
        ValueError,
        r"a metric named 'loss'",
    ),
    "metrics not a dict": (
        lambda w, b, rng: (_ce(_logits(w, b), b), [1.0]),
        TypeError,
        r"metrics that are a list; metrics must be a dict",
    ),
}


@pytest.mark.parametrize("case", list(BAD_RETURNS))
def test_a_loss_fn_that_returns_the_wrong_thing_is_named(case):
    loss_fn, kind, message = BAD_RETURNS[case]
    trainer, state = _trainer(loss_fn)
    with pytest.raises(kind, match=r"Trainer.step: loss_fn <lambda> returned " + message):
        trainer.step(state, BATCH)
    with pytest.raises(kind, match=r"Trainer.evaluate: loss_fn <lambda> returned " + message):
        trainer.evaluate(state, [BATCH])


def test_an_adapter_loss_that_returns_the_wrong_thing_is_named():
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(4)(x)

    def bare(logits, batch):
        return _ce(logits, batch)

    model = dp.Linen(Dense(), bare)
    params, ms = model.init(jax.random.key(0), BATCH)
    trainer = dp.Trainer(model, optax.sgd(0.1), mesh=mesh_1d(8, "data"))
    state = trainer.init(params, jax.random.key(0))
    with pytest.raises(
        TypeError,
        match=r"Trainer.step: the loss "
        r"test_an_adapter_loss.*bare given to dp.Linen "
        r"returned a bare loss",
    ):
        trainer.step(state, BATCH)


class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(4)(x)
        return nn.BatchNorm(axis_name="batch")(x, use_running_average=not train)


class NnxBN(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, axis_name="batch", rngs=rngs)

    def __call__(self, x):
        return self.bn(self.dense(x))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_a_batchnorm_over_another_axis_name_is_named(kind):
    loss = lambda logits, batch: (_ce(logits, batch), {})  # noqa: E731
    if kind == "linen":
        model = dp.Linen(LinenBN(), loss)
        params, ms = model.init(jax.random.key(0), BATCH)
    else:
        model = dp.Nnx(NnxBN(nnx.Rngs(0)), loss)
        params, ms = model.init()
    trainer = dp.Trainer(model, optax.sgd(0.1), mesh=mesh_1d(8, "data"))
    state = trainer.init(params, jax.random.key(0), model_state=ms)
    with pytest.raises(
        ValueError,
        match=r"Trainer.step: the model reduces over "
        r"axis_name='batch' \(a BatchNorm.*splits the batch "
        r"over axis_name='data'.*Build the layer with "
        r"axis_name='data'",
    ):
        trainer.step(state, BATCH)


def test_empty_batches_and_bad_fit_arguments_fail_before_training(tmp_path):
    trainer, state = _trainer(lambda w, b, rng: (_ce(_logits(w, b), b), {}))
    empty = {k: v[:0] for k, v in BATCH.items()}
    with pytest.raises(ValueError, match=r"Trainer.step: the batch has 0 examples"):
        trainer.step(state, empty)
    with pytest.raises(ValueError, match=r"Trainer.evaluate: the batch has 0 examples"):
        trainer.evaluate(state, [empty])

    class Untouchable:
        """Data that must not be read: the error comes before any step."""

        def __iter__(self):
            raise AssertionError("fit read the data before checking its arguments")

    a_file = tmp_path / "ckpt"
    a_file.write_text("not a directory")
    with pytest.raises(
        ValueError,
        match=r"Checkpointer: directory='.*ckpt' is a file, "
        r"not a directory",
    ):
        dp.Checkpointer(a_file)
    with pytest.raises(ValueError, match=r"Checkpointer: directory='.*' cannot be created"):
        dp.Checkpointer(a_file / "sub")
    with pytest.raises(
        ValueError,
        match=r"Checkpointer: every=0 must be at least 1 \(steps between saves\)",
    ):
        dp.Checkpointer(tmp_path, every=0)
    with pytest.raises(TypeError, match=r"Checkpointer: max_to_keep must be an int"):
        dp.Checkpointer(tmp_path, max_to_keep=2.5)
    with pytest.raises(
        TypeError,
        match=r"Trainer.fit: checkpoint must be a "
        r"dp.Checkpointer\(directory, every=...\) or None, got "
        r"str instead \(a path: pass dp.Checkpointer\('ckpt', "
        r"every=100\)\)",
    ):
        trainer.fit(state, Untouchable(), steps=5, checkpoint="ckpt")
    with pytest.raises(ValueError, match=r"dp.Evaluate: every=0 must be a positive number"):
        dp.Evaluate([BATCH], every=0)
    with pytest.raises(TypeError, match=r"callbacks must hold dp.Callback objects"):
        trainer.fit(state, Untouchable(), steps=5, callbacks=[3])
    with pytest.raises(
        TypeError,
        match=r"dp.Evaluate: data is a dict \(one batch\?\); "
        r"pass an iterable of global batches, e.g. \[data\]",
    ):
        dp.Evaluate(BATCH)
    with pytest.raises(TypeError, match=r"Trainer.evaluate: data is a dict"):
        trainer.evaluate(state, BATCH)
    assert int(state.step) == 0


def test_the_progress_interval_is_checked_before_training(capsys):
    # Before: log_every=0 raised ZeroDivisionError after the first step (p.step % log_every).
    trainer, state = _trainer(lambda w, b, rng: (_ce(_logits(w, b), b), {}))

    class Untouchable:
        def __iter__(self):
            raise AssertionError("fit read the data before checking its arguments")

    with pytest.raises(ValueError, match=r"dp.Progress: every=0 must be a positive number of"):
        dp.Progress(every=0)
    with pytest.raises(TypeError, match=r"dp.Progress: every must be an int, got None"):
        dp.Progress(every=None)
    with pytest.raises(
        TypeError, match=r"Trainer.fit: progress must be True, False, None .* got 'yes' of type"
    ):
        trainer.fit(state, Untouchable(), steps=5, progress="yes")
    with pytest.raises(
        TypeError, match=r"Trainer.fit\(\) got an unexpected keyword argument 'eval_freq'"
    ):
        trainer.fit(state, Untouchable(), steps=5, eval_freq=2)
    # the bar: on stderr, its loss every `every` steps (here every step: the last one's shown)
    _, history = trainer.fit(state, [BATCH] * 2, steps=2, progress=dp.Progress(every=1))
    assert [h["step"] for h in history] == [1, 2]
    err = capsys.readouterr().err
    assert "2/2" in err and f"loss={history[-1]['loss']:.4f}" in err


def test_a_param_that_is_no_array_is_named_with_its_path_and_the_fix():
    # Before: numpy's "TypeError: data type 'mlp' not understood", naming no leaf.
    trainer = dp.Trainer(lambda w, b, rng: (_ce(_logits(w, b), b), {}), optax.sgd(0.1))
    with pytest.raises(
        TypeError,
        match=r"Trainer.init: params\['name'\] is 'mlp' \(a str\), not an array; every leaf of "
        r"params is a param.*Keep other values \(names, settings\) out of the params",
    ):
        trainer.init({**W, "name": "mlp"}, jax.random.key(0))
    with pytest.raises(TypeError, match=r"params\['act'\] is <function .*\(a function\)"):
        trainer.init({**W, "act": lambda x: x}, jax.random.key(0))
    trainer.init({**W, "scale": 1.0}, jax.random.key(0))  # a Python float is a param


def test_constructor_errors_name_the_fix():
    loss = lambda w, b, rng: (_ce(_logits(w, b), b), {})  # noqa: E731
    with pytest.raises(
        TypeError,
        match=r"optax.adam is a function: call it, e.g. "
        r"optax.adam\(1e-3\)",
    ):
        dp.Trainer(loss, optax.adam)
    with pytest.raises(TypeError, match=r"extra must be a dp.Extra"):
        dp.Trainer(loss, optax.sgd(0.1), extra=lambda p: p)
    with pytest.raises(ValueError, match=r"dp.ema: decay=1.5"):
        dp.ema(1.5)
    with pytest.raises(TypeError, match=r"dp.Nnx: module must be a flax.nnx.Module"):
        dp.Nnx(LinenBN(), loss)
    with pytest.raises(
        TypeError,
        match=r"Trainer.to_module: this Trainer trains a plain "
        r"loss_fn",
    ):
        trainer, state = _trainer(loss)
        trainer.to_module(state)


@pytest.mark.parametrize(
    "kw, route",
    [
        ({}, r"averaged over the devices by all-reduce \(DDP\)"),
        ({"sync": dp.sync.ZeRO1()}, r"reduce-scattered .*\(ZeRO-1, sync=dp.sync.ZeRO1\(\)\)"),
        ({"sync": dp.sync.FSDP()}, r"reduce-scattered .*\(FSDP, sync=dp.sync.FSDP\(\)\)"),
    ],
)
def test_an_integer_param_is_named_with_its_path_dtype_and_the_fix(kw, route):
    # Before: every strategy failed inside jax.grad on the first step ("grad requires real- or
    # complex-valued inputs ... but got int32"), naming no leaf.
    def loss(p, b, rng):
        return _ce(_logits(p, b), b) + 0.0 * p["layer"]["count"].sum(), {}

    trainer = dp.Trainer(loss, optax.sgd(0.1), mesh=mesh_1d(8, "data"), **kw)
    message = (
        rf"params\['layer'\]\['count'\] has dtype int32, but every param is trained: "
        rf".*{route}.*Cast it \(e.g. jnp.float32\) if it should train; keep it out of "
        rf"the params if it should not"
    )
    with pytest.raises(TypeError, match=rf"Trainer.init: {message}"):
        trainer.init({**W, "layer": {"count": np.arange(8, dtype=np.int32)}}, jax.random.key(0))
    # A state whose params were replaced after init: named when the step is traced.
    state = trainer.init(W, jax.random.key(0))
    bad = state.replace(params={**state.params, "layer": {"count": jnp.arange(8)}})
    with pytest.raises(TypeError, match=rf"Trainer.step: {message}"):
        trainer.step(bad, BATCH)


def test_params_split_over_a_non_data_axis_are_refused_not_made_whole():
    # A tensor-parallel placement (P(None, "model")) on the Trainer's mesh: init and step
    # would gather the leaf whole on every device; they raise naming the leaf and the fix.
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

    def loss(p, batch, rng):
        return jnp.mean((batch["x"] @ p["w"]) ** 2), {}

    trainer = dp.Trainer(loss, optax.sgd(0.1), mesh=mesh, layout=dp.Layout(replicate="data"))
    whole = {"w": np.ones((8, 4), np.float32)}
    split = {"w": jax.device_put(whole["w"], NamedSharding(mesh, P(None, "model")))}
    want = (
        r"params\['w'\] is placed P\(None, 'model'\), split over the mesh axis 'model', "
        r"which has no role in this Trainer \(data axes \('data',\).*"
        r"dp.Layout\(tensor='model'\).*or pass the leaf replicated over it"
    )
    with pytest.raises(ValueError, match=r"Trainer\.init: " + want):
        trainer.init(split, jax.random.key(0))
    state = trainer.init(whole, jax.random.key(0))  # replicated: fine
    batch = {"x": np.ones((8, 8), np.float32)}
    state, _ = trainer.step(state, batch)
    with pytest.raises(ValueError, match=r"Trainer\.step: " + want):
        trainer.step(state.replace(params=split), batch)
    # Over the data axis (another strategy's placement) is still taken as it is.
    data_split = {"w": jax.device_put(whole["w"], NamedSharding(mesh, P("data")))}
    trainer.init(data_split, jax.random.key(0))
