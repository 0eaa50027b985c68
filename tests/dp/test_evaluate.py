"""Trainer.evaluate: the exact per-example mean over any number of examples, in batches of
any sizes (not multiples of the device count), or a dp.Batches (every example once)."""

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
