"""Trainer.evaluate: the exact per-example mean over any number of examples, in batches of
any sizes (not multiples of the device count), or a dp.Batches (every example once); fit's
dp.Evaluate reaches it through Trainer.evaluate, the one door."""

from __future__ import annotations

import jax
import numpy as np
import optax

from jaxcoll import dp
from tests.dp._models import MLP, batches, cross_entropy
from tests.helpers import mesh_1d


def test_evaluate_is_exact_on_any_number_of_examples():
    model = dp.Linen(MLP(), cross_entropy)
    test = batches("mlp", 1, 203, seed=9)[0]  # 203 = 25 * 8 + 3: not a multiple of 8
    params, ms = model.init(jax.random.key(0), test)
    trainer = dp.Trainer(model, optax.adam(1e-2), mesh=mesh_1d(8, "data"))
    state = trainer.init(params, jax.random.key(1), model_state=ms)
    logits = MLP().apply({"params": params}, test["x"])
    loss, aux = cross_entropy(logits, test)
    want = (float(loss), float(aux["accuracy"]))
    rows = lambda lo, hi: {k: v[lo:hi] for k, v in test.items()}  # noqa: E731
    cases = {
        "one batch of 203": [test],
        "64, 64, 64, 11": [rows(0, 64), rows(64, 128), rows(128, 192), rows(192, 203)],
        "3, 200 (a batch smaller than n)": [rows(0, 3), rows(3, 203)],
        "dp.Batches(shuffle, drop_last)": dp.Batches(test, 64, shuffle=True, drop_last=True),
    }
    for name, data in cases.items():
        got = trainer.evaluate(state, data)
        np.testing.assert_allclose((got["loss"], got["accuracy"]), want, rtol=1e-5, err_msg=name)


def test_fit_evaluates_through_trainer_evaluate():
    # One door: dp.Evaluate asks trainer.evaluate, once per set at each evaluation, and
    # reports exactly its results.
    model = dp.Linen(MLP(), cross_entropy)
    train = batches("mlp", 1, 256)[0]
    test = batches("mlp", 1, 203, seed=9)[0]
    params, ms = model.init(jax.random.key(0), train)
    trainer = dp.Trainer(model, optax.adam(1e-2), mesh=mesh_1d(8, "data"))
    state = trainer.init(params, jax.random.key(1), model_state=ms)
    evaluate, calls = trainer.evaluate, []

    def counted(state, data):
        calls.append((int(state.step), "val" if data is val else "sample"))
        return evaluate(state, data)

    trainer.evaluate = counted
    val, sample = dp.Batches(test, 64), [test]
    evals = dp.Evaluate({"val": val, "sample": sample}, every=2)
    state, history = trainer.fit(
        state, dp.Batches(train, 64), steps=4, callbacks=[evals], progress=False
    )
    assert calls == [(2, "val"), (2, "sample"), (4, "val"), (4, "sample")]
    want = {f"eval_val_{k}": v for k, v in evaluate(state, val).items()}
    want |= {f"eval_sample_{k}": v for k, v in evaluate(state, sample).items()}
    assert {k: v for k, v in history[-1].items() if k.startswith("eval_")} == want
