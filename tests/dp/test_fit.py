"""Trainer.fit as a training loop: callbacks as things happen, evaluation every k steps (of
one set or named sets), at most two steps in flight with the next batch prefetched; what
callbacks ask (save, stop: SaveBest, EarlyStopping), the step-numbering convention, the step
metrics (time, throughput, FLOPs, MFU, learning rate, memory), TensorBoard, the plot and the
profile."""

from __future__ import annotations

import glob
import itertools
import json
import os
import time

import jax
import numpy as np
import optax
import pytest

from jaxcoll import dp
from jaxcoll.dp.reports.metrics import matmul_flops
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
        callbacks=[
            dp.Evaluate(dp.Batches(test, 64), every=4),
            done,
            rec,
            writer,
            dp.JsonlWriter(tmp_path / "m.jsonl"),
        ],
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


# ------------------------------------------------------------------------------------------
# One Trainer for the tests below (one step and one evaluation program, compiled once): Adam
# under optax.inject_hyperparams with a decaying learning rate, so `lr` varies by step.
SCHEDULE = optax.linear_schedule(3e-2, 3e-3, 16)


@pytest.fixture(scope="module")
def run():
    model = dp.Linen(MLP(), cross_entropy)
    train = batches("mlp", 1, 256)[0]
    test = batches("mlp", 1, 203, seed=9)[0]
    # A validation set with 60% of its labels replaced by random ones: its loss falls for a
    # step, then rises as the model learns the true rule (SaveBest and EarlyStopping act).
    rng = np.random.default_rng(3)
    noisy = {"x": test["x"], "y": test["y"].copy()}
    flip = rng.random(len(noisy["y"])) < 0.6
    noisy["y"][flip] = rng.integers(0, 4, flip.sum())
    params, ms = model.init(jax.random.key(0), train)
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
    trainer = dp.Trainer(model, optimizer, mesh=mesh_1d(8, "data"))

    def fresh():
        return trainer.init(params, jax.random.key(1), model_state=ms)

    return trainer, fresh, params, dp.Batches(train, 64), test, noisy


def _loss(params, batch):  # the plain loss function, on the host's params
    logits = MLP().apply({"params": jax.device_get(params)}, batch["x"])
    return float(cross_entropy(logits, batch)[0])


def test_named_eval_sets_numbering_and_step_metrics(run):
    trainer, fresh, params, data, test, noisy = run
    sets = {"val": dp.Batches(test, 64), "train": [data[0], data[1]]}
    rec = Recorder([])
    peak = 2.5e9
    comps = [dp.Evaluate(sets, every=3), dp.Throughput(tokens_per_example=7, peak_flops=peak)]
    state3, hist = trainer.fit(fresh(), data, steps=3, callbacks=[rec, *comps])
    assert int(state3.step) == 3
    # each named set is evaluated on the state after 3 updates, results keyed <name>_<metric>
    want = {
        f"{name}_{k}": v for name, d in sets.items() for k, v in trainer.evaluate(state3, d).items()
    }
    assert sorted(want) == ["train_accuracy", "train_loss", "val_accuracy", "val_loss"]
    assert rec.evals == [(3, want)]
    assert {k: v for k, v in hist[-1].items() if k.startswith("eval_")} == {
        f"eval_{k}": v for k, v in want.items()
    }
    # numbering: step 1's loss is the initial params' loss on batch 0 (the plain loss function)
    assert [h["step"] for h in hist] == [1, 2, 3]
    np.testing.assert_allclose(hist[0]["loss"], _loss(params, data[0]), rtol=1e-5)
    state6, more = trainer.fit(state3, data, steps=6, callbacks=[rec, *comps])
    assert [h["step"] for h in more] == [4, 5, 6]
    assert rec.evals[-1] == (
        6,
        {f"{n}_{k}": v for n, d in sets.items() for k, v in trainer.evaluate(state6, d).items()},
    )

    # step metrics, against values computed apart from fit
    step, args = trainer.step_program(state6, data[0])
    compiled = step.lower(*args).compile()
    flops = compiled.cost_analysis()["flops"] * 8  # XLA counts one device's program
    mem = compiled.memory_analysis()
    # the three matmuls' FLOPs (16-32-32-4, batch 64) forward, for the weight gradients and
    # for the input gradients of the last two; Adam and the elementwise work add < 60%
    matmuls = 2 * 64 * (16 * 32 + 32 * 32 + 32 * 4) * 2 + 2 * 64 * (32 * 32 + 32 * 4)
    assert matmul_flops(step.trace(*args).jaxpr) == matmuls
    assert matmuls < flops <= 1.6 * matmuls
    for h in hist + more:
        m = rec.steps[h["step"] - 1][1]
        assert {k: h[k] for k in m} == m
        assert h["step_time_s"] > 0
        assert h["examples_per_s"] == pytest.approx(64 / h["step_time_s"], rel=1e-12)
        assert h["tokens_per_s"] == pytest.approx(7 * h["examples_per_s"], rel=1e-12)
        assert h["flops_per_step"] == flops  # XLA's count: above the matmuls alone
        assert h["mfu"] == pytest.approx(flops / h["step_time_s"] / (peak * 8), rel=1e-12)
        assert h["memory_bytes"] == mem.argument_size_in_bytes + mem.temp_size_in_bytes  # CPU
        # the rate the step used: the schedule at the step count before the update
        assert h["lr"] == pytest.approx(float(SCHEDULE(h["step"] - 1)), rel=1e-6)
    assert hist[0]["step_time_s"] > hist[1]["step_time_s"]  # the first step compiles

    # named sets that are not: the keys name sets, each value is batches
    for bad, match in (
        ({1: [data[0]]}, r"dp.Evaluate: data's keys name the evaluation sets .* got 1 of type int"),
        ({"val": data[0]}, r"data\['val'\] is a dict \(one batch\?\); each named set"),
        ({"val": 3}, r"data\['val'\] is a int, not batches"),
        (None, r"dp.Evaluate: data is None; pass the evaluation batches"),
    ):
        with pytest.raises(TypeError, match=match):
            dp.Evaluate(bad)
    with pytest.raises(ValueError, match=r"dp.Evaluate: data is an empty dict"):
        dp.Evaluate({})


def test_eval_on_start_evaluates_the_starting_state_before_the_first_step(run, tmp_path):
    # nanoGPT's evaluation at iteration 0: the initial state, then (resumed) the restored one.
    trainer, fresh, params, data, test, noisy = run
    val = dp.Batches(test, 64)
    want0 = trainer.evaluate(fresh(), val)
    rec = Recorder([])
    ckpt = dp.Checkpointer(tmp_path / "ckpt", every=2)
    evals = dp.Evaluate(val, every=2, on_start=True)
    state, hist = trainer.fit(fresh(), data, steps=2, callbacks=[rec, evals], checkpoint=ckpt)
    assert rec.evals[0] == (0, want0)
    assert hist[0] == {"step": 0, **{f"eval_{k}": v for k, v in want0.items()}}
    assert [h["step"] for h in hist] == [0, 1, 2]
    assert [step for step, _ in rec.evals] == [0, 2]  # and every `every` steps, as before
    want2 = trainer.evaluate(state, val)
    # Resumed from step 2's checkpoint: the restored state is evaluated, as step 2.
    rec2 = Recorder([])
    ckpt = dp.Checkpointer(tmp_path / "ckpt", every=2)
    _, more = trainer.fit(fresh(), data, steps=3, callbacks=[rec2, evals], checkpoint=ckpt)
    assert rec2.evals[0] == (2, want2) and more[0]["step"] == 2
    assert [h["step"] for h in more] == [2, 3]
    assert rec2.evals[0][1]["loss"] != want0["loss"]
    with pytest.raises(TypeError, match=r"dp.Evaluate: on_start must be True or False, got 1"):
        dp.Evaluate(val, on_start=1)
    with pytest.raises(ValueError, match=r"dp.Evaluate: every=0 must be a positive number"):
        dp.Evaluate(val, every=0)


class Slow:
    """Batches that take ``wait`` seconds each to build (``repeat``: endlessly, cycling)."""

    def __init__(self, data, wait, repeat=True):
        self.data, self.wait, self.repeat = data, wait, repeat

    def __iter__(self):
        for i in itertools.count() if self.repeat else range(len(self.data)):
            time.sleep(self.wait)
            yield self.data[i % len(self.data)]


class SlowOnEval(dp.Callback):
    def on_eval(self, step, results):
        time.sleep(0.3)  # a writer, a plot: the evaluation's host work, not the next step's


def test_the_step_after_an_evaluation_or_a_save_measures_its_own_time(run, tmp_path):
    # Before: the step after an evaluation counted the on_eval callbacks and two turns of the
    # loop (its own and the next batch's), as did the step after a save: 2.1-2.4x the
    # steady step time when building a batch takes longer than a step (here 0.2 s a batch).
    trainer, fresh, params, data, test, noisy = run
    _, hist = trainer.fit(
        fresh(),
        Slow([data[i] for i in range(4)], 0.2),
        steps=14,
        checkpoint=dp.Checkpointer(tmp_path / "ckpt", every=6, max_to_keep=1),
        callbacks=[dp.Evaluate(Slow([test], 0.2, repeat=False), every=4), SlowOnEval()],
    )
    times = {h["step"]: h["step_time_s"] for h in hist if "step_time_s" in h}
    assert sorted(times) == list(range(1, 15))
    steady = float(np.median([times[s] for s in range(2, 14)]))
    assert 0.15 < steady < 0.3, times  # one batch built per step
    # 5, 9, 13: after an evaluation; 7 and 13: after a save. (The last step builds no next
    # batch: its time is the device's.)
    for s in range(2, 14):
        assert 0.5 * steady < times[s] < 1.5 * steady, (s, times)


def _improving(values, mode="min"):
    """The indices where a running best improves (an oracle apart from dp.SaveBest)."""
    best, out = None, []
    for i, v in enumerate(values):
        if best is None or (v < best if mode == "min" else v > best):
            best = v
            out.append(i)
    return out


def test_save_best_and_early_stopping(run, tmp_path):
    trainer, fresh, _, data, _, noisy = run
    rec = Recorder([])
    best, stop = dp.SaveBest("eval_val_loss"), dp.EarlyStopping("eval_val_loss", patience=3)
    ckpt = dp.Checkpointer(tmp_path / "best", every=None, max_to_keep=100)
    state, hist = trainer.fit(
        fresh(),
        data,
        steps=16,
        checkpoint=ckpt,
        callbacks=[dp.Evaluate({"val": [noisy]}, every=1), rec, best, stop],
    )
    losses = [r["val_loss"] for _, r in rec.evals]
    steps = [s for s, _ in rec.evals]
    saves = [steps[i] for i in _improving(losses)]
    assert 2 <= len(saves) < len(steps)  # it improves, then stalls
    # SaveBest asked at exactly the improving steps, and only those were saved (every=None)
    assert best.saved == saves
    assert sorted(int(d) for d in os.listdir(tmp_path / "best") if d.isdigit()) == saves
    # EarlyStopping: 3 evaluations in a row without a new best end the run after that step
    last_best = steps.index(saves[-1])
    want_stop = steps[last_best + 3]
    assert stop.stopped_step == want_stop == int(state.step) == hist[-1]["step"] == steps[-1]
    assert stop.best == best.best == min(losses) and best.best_step == saves[-1]
    # the newest checkpoint is the best state: what a new run restores
    assert (
        int(dp.Checkpointer(tmp_path / "best", every=None).restore_latest(fresh()).step)
        == saves[-1]
    )

    # mode="max" on accuracy; a metric absent from the results; per-process metrics refused
    with pytest.raises(ValueError, match=r"metric='eval_val_loss' is not among the values"):
        trainer.fit(
            fresh(),
            data,
            steps=1,
            callbacks=[dp.Evaluate([noisy]), dp.EarlyStopping("eval_val_loss")],
        )
    with pytest.raises(ValueError, match=r"metric='step_time_s' is measured by each process"):
        dp.SaveBest("step_time_s")
    with pytest.raises(ValueError, match=r"patience=0 must be at least 1 \(checks without"):
        dp.EarlyStopping(patience=0)
    with pytest.raises(ValueError, match=r"mode='lowest' must be 'min'"):
        dp.SaveBest(mode="lowest")
    with pytest.raises(
        ValueError, match=r"SaveBest asks to save checkpoints, and fit has no checkpoint="
    ):
        trainer.fit(
            fresh(), data, steps=1, callbacks=[dp.Evaluate([noisy]), dp.SaveBest("eval_loss")]
        )


class _Untouchable:
    def __iter__(self):
        raise AssertionError("fit read the data before checking its keywords")


# fit's keywords before its components, and (a pattern of) the replacement each error names.
REPLACED = {
    "eval_data": r"callbacks=\[dp.Evaluate\(eval_data, every=eval_every, on_start=",
    "eval_every": r"callbacks=\[dp.Evaluate\(eval_data, every=eval_every, on_start=",
    "eval_on_start": r"callbacks=\[dp.Evaluate\(eval_data, .*on_start=eval_on_start\)\]",
    "tokens_per_example": r"callbacks=\[dp.Throughput\(tokens_per_example=\.\.\., ",
    "peak_flops": r"callbacks=\[dp.Throughput\(.*peak_flops=\.\.\.\)\]",
    "profile_steps": r"callbacks=\[dp.Profile\(profile_dir, steps=profile_steps\)\]",
    "profile_dir": r"callbacks=\[dp.Profile\(profile_dir, steps=profile_steps\)\]",
    "log_every": r"progress=dp.Progress\(every=log_every\)",
}


@pytest.mark.parametrize("keyword", sorted(REPLACED))
def test_each_keyword_before_the_components_raises_naming_its_replacement(run, keyword):
    trainer, fresh, *_ = run
    state = fresh()
    with pytest.raises(
        TypeError, match=rf"Trainer.fit: {keyword}= is gone; pass {REPLACED[keyword]}"
    ):
        trainer.fit(state, _Untouchable(), steps=3, **{keyword: 1})
    assert int(state.step) == 0


def test_old_keywords_together_name_each_replacement_and_unknown_ones_are_refused(run):
    trainer, fresh, *_ = run
    with pytest.raises(
        TypeError,
        match=r"Trainer.fit: eval_data=, eval_every=, tokens_per_example= are gone; pass "
        r"callbacks=\[dp.Evaluate\(eval_data, every=eval_every, on_start=eval_on_start\)\]; "
        r"callbacks=\[dp.Throughput\(tokens_per_example=\.\.\., peak_flops=\.\.\.\)\] "
        r"instead\.",
    ):
        trainer.fit(
            fresh(), _Untouchable(), steps=3, eval_data=[1], eval_every=2, tokens_per_example=7
        )
    with pytest.raises(
        TypeError, match=r"Trainer.fit\(\) got an unexpected keyword argument 'evals'; it takes"
    ):
        trainer.fit(fresh(), _Untouchable(), steps=3, evals=[1])


def test_throughput_measures_the_peak_once_and_keeps_it_in_the_first_step(run, monkeypatch, capsys):
    trainer, fresh, _, data, test, _ = run
    calls = []

    def measured():
        calls.append(1)
        return 2.0e9

    monkeypatch.setattr("jaxcoll.dp.loop.components.measure_peak_flops", measured)
    comps = [dp.Evaluate([test], on_start=True), dp.Throughput(peak_flops="measure")]
    _, hist = trainer.fit(fresh(), data, steps=3, callbacks=comps)
    assert calls == [1]
    assert "Trainer.fit: measured peak 2e+09 FLOP/s per device" in capsys.readouterr().err
    steps = [h for h in hist if "loss" in h]  # the first entry is the evaluation at step 0
    assert [h["step"] for h in hist] == [0, 1, 2, 3] and "loss" not in hist[0]
    assert [h.get("peak_flops") for h in steps] == [2.0e9, None, None]
    for h in steps:
        assert h["mfu"] == pytest.approx(h["flops_per_step"] / h["step_time_s"] / (2.0e9 * 8))
        assert "tokens_per_s" not in h


class StopAt(dp.Callback):
    def __init__(self, at, action=dp.Action.STOP):
        self.at, self.action = at, action

    def on_step(self, step, metrics):
        return self.action if step == self.at else None


def test_a_callback_stops_or_saves_from_on_step(run, tmp_path):
    trainer, fresh, _, data, _, _ = run
    # prefetch=False: the loop holds the state after step 3 when step 3 is reported
    state, hist = trainer.fit(fresh(), data, steps=10, callbacks=[StopAt(3)], prefetch=False)
    assert int(state.step) == 3 and [h["step"] for h in hist] == [1, 2, 3]
    # prefetch=True: step 4 is in flight when step 3 is reported; it finishes and is reported
    ckpt = dp.Checkpointer(tmp_path / "c", every=None, max_to_keep=10)
    both = StopAt(3, dp.Action.SAVE | dp.Action.STOP)
    state, hist = trainer.fit(fresh(), data, steps=10, callbacks=[both], checkpoint=ckpt)
    assert int(state.step) == 4 and [h["step"] for h in hist] == [1, 2, 3, 4]
    assert sorted(int(d) for d in os.listdir(tmp_path / "c") if d.isdigit()) == [4]
    # a plain function may return an Action too; other return values are not requests
    state, hist = trainer.fit(
        fresh(),
        data,
        steps=10,
        prefetch=False,
        callbacks=[lambda s, m: dp.Action.STOP if s == 2 else 0],
    )
    assert int(state.step) == 2
    with pytest.raises(
        RuntimeError, match=r"returned dp.Action.SAVE at step 2, and fit has no checkpoint="
    ):
        trainer.fit(fresh(), data, steps=10, callbacks=[StopAt(1, dp.Action.SAVE)])
    with pytest.raises(
        TypeError, match=r"StopAt.on_step returned 'stop' of type str; a callback returns None"
    ):
        trainer.fit(fresh(), data, steps=10, callbacks=[StopAt(1, "stop")])


def test_tensorboard_plot_and_profile(run, tmp_path):
    trainer, fresh, _, data, test, _ = run
    tb = dp.TensorBoardWriter(tmp_path / "tb")
    png = tmp_path / "plot" / "run.png"
    ends = []

    class End(dp.Callback):
        def on_end(self, step, history):
            ends.append((step, len(history)))

    state, hist = trainer.fit(
        fresh(),
        data,
        steps=5,
        callbacks=[
            dp.Profile(tmp_path / "profile", steps=(2, 4)),
            dp.Evaluate({"val": [test]}, every=2),
            tb,
            dp.PlotWriter(png, title="test"),
            End(),
        ],
    )
    assert ends == [(5, 5)]
    # the event file holds every step's loss and every evaluation, as float32
    scalars = dp.read_scalars(tmp_path / "tb")
    assert scalars["loss"] == [(h["step"], float(np.float32(h["loss"]))) for h in hist]
    assert scalars["eval_val_loss"] == [
        (h["step"], float(np.float32(h["eval_val_loss"]))) for h in hist if "eval_val_loss" in h
    ]
    assert [s for s, _ in scalars["eval_val_loss"]] == [2, 4, 5]
    assert {"lr", "flops_per_step", "step_time_s", "examples_per_s"} <= set(scalars)
    # the plot: a PNG with something drawn
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[0] > 300 and image.std() > 0.05
    # the trace of steps 2 and 3
    assert glob.glob(str(tmp_path / "profile" / "**" / "*.xplane.pb"), recursive=True)
    drawn = dp.plot_trace(tmp_path / "profile", tmp_path / "trace.png")
    assert "jaxcoll(step)" in dict(drawn["ops"])  # the Trainer's step was run
    assert drawn["threads"][0][1] > 0 and 0 < drawn["span_s"] < 60
    assert matplotlib.image.imread(tmp_path / "trace.png").std() > 0.05
    for make, match in (
        (lambda: dp.Profile(tmp_path, steps=(3, 3)), r"dp.Profile: steps=\(3, 3\) must have 1 <="),
        (lambda: dp.Profile(tmp_path, steps=(0, 2)), r"must have 1 <= start < stop"),
        (lambda: dp.Throughput(peak_flops=-1.0), r"peak_flops=-1.0 must be the peak FLOP/s"),
        (lambda: dp.Throughput(tokens_per_example=0), r"tokens_per_example=0 must be a positive"),
        (lambda: dp.Throughput(), r"dp.Throughput: pass tokens_per_example= .* and/or peak_flops="),
    ):
        with pytest.raises(ValueError, match=match):
            make()
    with pytest.raises(TypeError, match=r"dp.Profile: steps must be a pair of ints"):
        dp.Profile(tmp_path, steps=2)
    with pytest.raises(TypeError, match=r"dp.Profile: directory must be a path"):
        dp.Profile(None, steps=(2, 4))


def test_a_step_read_in_the_turn_of_the_one_before_gets_its_time_not_the_dispatch_gap(
    monkeypatch,
):
    # The step clock driven by hand, with the times the runner's calls see when evaluating
    # every 2 steps: after the evaluation (restart), step 3 is dispatched with nothing to
    # read, step 4 a few microseconds later, and both are read in the next turn (the drain
    # before the next evaluation), each when the device finishes it, 0.5 s apart. Before,
    # step 4 got the 10 us between the two dispatches: 4 examples at 400000 examples/s
    # (`examples/gpt.py --tiny --layout single --eval-every 2` logged such readings).
    from types import SimpleNamespace

    from jaxcoll.dp.reports import metrics as m

    now = [0.0]
    monkeypatch.setattr(m.time, "perf_counter", lambda: now[0])
    meter = m.StepMetrics(SimpleNamespace(mesh=None, donate=True), SimpleNamespace(opt_state=()))
    costs = m.Costs(None, None)

    def at(t, f, *args):
        now[0] = t
        return f(*args)

    at(10.0, meter.restart)
    sent3 = at(10.0, meter.dispatched)
    sent4 = at(10.00001, meter.dispatched)
    got = [
        at(10.5, meter.complete, 3, 4, costs, sent3),
        at(11.0, meter.complete, 4, 4, costs, sent4),
    ]
    assert [g["step_time_s"] for g in got] == pytest.approx([0.5, 0.5])
    assert [g["examples_per_s"] for g in got] == pytest.approx([8.0, 8.0])
