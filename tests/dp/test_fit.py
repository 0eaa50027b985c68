"""Trainer.fit as a training loop: callbacks as things happen, evaluation every k steps,
at most two steps in flight with the next batch prefetched."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax

from jaxcoll import dp
from tests.dp._models import MLP, batches, cross_entropy
from tests.helpers import mesh_1d


class Logged(dp.Batches):
    """Batches that log each request, to see when fit builds a batch."""

    def __init__(self, *args, log, **kw):
        super().__init__(*args, **kw)
        self.log = log

    def __getitem__(self, step):
        self.log.append(("get", step))
        return super().__getitem__(step)


class Recorder(dp.Callback):
    def __init__(self, log):
        self.log, self.steps, self.evals = log, [], []

    def on_step(self, step, metrics):
        self.log.append(("done", step))
        self.steps.append((step, metrics))

    def on_eval(self, step, results):
        self.log.append(("eval", step))
        self.evals.append((step, results))


class Writer:  # clu.metric_writers' interface
    def __init__(self):
        self.rows = []

    def write_scalars(self, step, scalars):
        self.rows.append((step, dict(scalars)))


def _setup():
    model = dp.Linen(MLP(), cross_entropy)
    train = batches("mlp", 1, 256)[0]
    test = batches("mlp", 1, 203, seed=9)[0]  # 203 = 25 * 8 + 3: not a multiple of 8
    params, ms = model.init(jax.random.key(0), train)
    trainer = dp.Trainer(model, optax.adam(1e-2), mesh=mesh_1d(8, "data"))
    return trainer, params, ms, train, test


def _want(state, data):
    logits = MLP().apply({"params": jax.device_get(state.params)}, data["x"])
    loss, aux = cross_entropy(logits, data)
    return float(loss), float(aux["accuracy"])


def test_fit_reports_steps_and_evaluations_as_they_happen(tmp_path, capsys):
    trainer, params, ms, train, test = _setup()
    inflight, peak, log = [0], [0], []
    step = trainer.step

    def counted(state, batch):  # fit dispatches every step through trainer.step
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        log.append(("dispatch", int(jax.device_get(state.step)) + 1))
        return step(state, batch)

    trainer.step = counted
    rec, writer, calls = Recorder(log), Writer(), []

    def done(step, metrics):
        inflight[0] -= "loss" in metrics  # a step finished (evaluations have eval_ keys)
        calls.append((step, metrics))

    state = trainer.init(params, jax.random.key(1), model_state=ms)
    state, hist = trainer.fit(
        state,
        Logged(train, 64, log=log),
        epochs=3,
        eval_data=dp.Batches(test, 64),
        eval_every=4,
        callbacks=[done, rec, writer, dp.JsonlWriter(tmp_path / "m.jsonl")],
    )

    assert capsys.readouterr().err == ""  # stderr is not a terminal: no progress bar
    assert [h["step"] for h in hist] == list(range(1, 13))
    assert [s for s, _ in rec.steps] == list(range(1, 13))
    for h, (_, m) in zip(hist, rec.steps):
        assert {k: h[k] for k in m} == m and m["examples_per_s"] > 0
    assert [s for s, _ in rec.evals] == [4, 8, 12]
    for s, results in rec.evals:
        assert {f"eval_{k}": v for k, v in results.items()} == {
            k: v for k, v in hist[s - 1].items() if k.startswith("eval_")
        }
    assert hist[-1]["loss"] < hist[0]["loss"]
    np.testing.assert_allclose(
        (hist[-1]["eval_loss"], hist[-1]["eval_accuracy"]), _want(state, test), rtol=1e-5
    )
    # the same events reach a metric writer, a function and the JSON-lines file
    assert writer.rows == [(s, m) for s, m in calls]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r.pop("step"), r) for r in lines] == writer.rows
    assert len(lines) == 12 + 3
    # Step s+1 is dispatched and batch s+1 built before step s is reported: the host work and
    # the transfer overlap the step; never more than two steps are in flight.
    assert peak[0] == 2
    assert log[:8] == [
        ("get", 0),
        ("dispatch", 1),
        ("get", 1),
        ("dispatch", 2),
        ("get", 2),
        ("done", 1),
        ("dispatch", 3),
        ("get", 3),
    ]
    i = log.index(("eval", 4))
    assert log[i - 2 : i + 3] == [
        ("done", 3),
        ("done", 4),
        ("eval", 4),
        ("dispatch", 5),
        ("get", 5),
    ]

    # prefetch=False: one step at a time
    log.clear()
    state = trainer.init(params, jax.random.key(1), model_state=ms)
    state, _ = trainer.fit(
        state, Logged(train, 64, log=log), steps=3, callbacks=[rec], prefetch=False
    )
    assert log == [
        ("get", 0),
        ("dispatch", 1),
        ("done", 1),
        ("get", 1),
        ("dispatch", 2),
        ("done", 2),
        ("get", 2),
        ("dispatch", 3),
        ("done", 3),
    ]
