"""The flight recorder (jaxcoll._watch.recorder), its analysis (jaxcoll.trace) and the two
collective timeouts, in one process.

The jobs whose records name a hang or a mismatch across processes are in
tests/multihost/test_hangs.py.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import jaxcoll
from jaxcoll import _watch, trace
from jaxcoll import distributed as dist
from jaxcoll._watch import process, recorder

HERE = os.path.abspath(__file__)


@pytest.fixture
def recording(monkeypatch):
    """The watchdog and recorder on (a 600 s timeout), back off afterwards."""
    monkeypatch.delenv("JAXCOLL_TRACE_BUFFER", raising=False)
    _watch.configure(600, "off")
    recorder._calls.clear()
    yield
    _watch.configure(0, "off")


def _line_of(text: str) -> int:
    with open(HERE) as fh:
        for n, line in enumerate(fh, 1):
            if text in line and "_line_of" not in line:
                return n
    raise AssertionError(text)


def _wait_done(n: int) -> None:
    """Until the watchdog thread has stamped the last ``n`` recorded calls complete."""
    deadline = time.monotonic() + 10
    while any(c.done is None for c in list(recorder._calls)[-n:]):
        assert time.monotonic() < deadline, "the watchdog never saw the calls complete"
        time.sleep(0.05)


def test_each_dist_call_is_recorded_with_its_options_shapes_and_call_site(recording, tmp_path):
    x = dist.per_rank(lambda r: np.full((3,), r, np.float32))
    before = recorder._seq
    a = dist.all_reduce(x, op="max")  # recorded: all_reduce
    b = dist.broadcast(x, src=2)  # recorded: broadcast
    np.testing.assert_array_equal(dist.to_ranks(a)[0], np.full(3, 7.0))
    np.testing.assert_array_equal(dist.to_ranks(b)[5], np.full(3, 2.0))
    _wait_done(2)
    path = jaxcoll.dump_trace(tmp_path / "rec.json")
    with open(path) as fh:
        data = json.load(fh)
    assert data["process"] == 0 and data["num_processes"] == 1
    assert data["reason"] == "dump_trace" and data["timeout"] == 600
    calls = data["calls"][-2:]
    assert [c["op"] for c in calls] == ["dist.all_reduce", "dist.broadcast"]
    assert [c["options"] for c in calls] == ["op=MAX", "src=2"]
    assert [c["args"] for c in calls] == ["float32[8,3]"] * 2
    assert [c["seq"] for c in calls] == [before + 1, before + 2]
    assert calls[1]["group_seq"] == calls[0]["group_seq"] + 1 and calls[0]["group"] == [0]
    assert [c["site"] for c in calls] == [
        f"{HERE}:{_line_of('# recorded: all_reduce')}",
        f"{HERE}:{_line_of('# recorded: broadcast')}",
    ]
    for c in calls:
        assert c["issued"] <= c["done"] <= data["time"]
    assert calls[0]["fingerprint"] != calls[1]["fingerprint"]
    # The main thread's stack at the dump, outermost first, ends in this test.
    assert any(f.startswith(f"{HERE}:") and "in test_each_dist_call" in f for f in data["stack"])


def test_the_ring_keeps_the_newest_calls_and_numbers_go_on(recording, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXCOLL_TRACE_BUFFER", "3")
    _watch.configure(600, "off")
    x = dist.per_rank(lambda r: np.ones((2,), np.float32))
    first = recorder._seq + 1
    for _ in range(5):
        dist.all_reduce(x)
    data = recorder.snapshot("test")
    assert [c["seq"] for c in data["calls"]] == [first + 2, first + 3, first + 4]
    assert data["calls_recorded"] == first + 4


def test_a_pytree_step_records_its_first_leaves_and_the_leaf_count(recording):
    tree = {f"w{i}": np.zeros((i + 1,), np.int32) for i in range(6)}
    sig = recorder._signature(tree)
    assert recorder.describe(sig) == ("int32[1], int32[2], int32[3], int32[4], ... 6 arrays")


def test_two_timeouts_first_completion_then_steady(recording):
    _watch.configure(5, "off", 50)
    assert (process.settings.timeout, process.settings.first_timeout) == (5, 50)
    x = dist.per_rank(lambda r: np.ones((4,), np.float32))
    dist.all_reduce(x)
    dist.all_reduce(x)
    dist.all_reduce(dist.per_rank(lambda r: np.ones((5,), np.float32)))  # new shapes
    _wait_done(3)
    calls = list(recorder._calls)[-3:]
    assert [(c.first, c.limit) for c in calls] == [(True, 50), (False, 5), (True, 50)]


@pytest.mark.parametrize(
    ("args", "env", "match"),
    [
        ((10, "off", 5), {}, r"init: first_timeout=5 is shorter than timeout=10"),
        (("env", "off", "env"), {"JAXCOLL_TRACE_BUFFER": "many"}, "JAXCOLL_TRACE_BUFFER='many'"),
        (("env", "off", "env"), {"JAXCOLL_FIRST_TIMEOUT": "x"}, "JAXCOLL_FIRST_TIMEOUT='x'"),
    ],
)
def test_bad_settings_name_the_setting_and_the_fix(monkeypatch, args, env, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        _watch.configure(*args)
    monkeypatch.undo()
    _watch.configure(0, "off")


def test_defaults_steady_300_first_600_and_never_below_the_timeout():
    process.configure("env", "off", joined=True)
    assert (process.settings.timeout, process.settings.first_timeout) == (
        300.0,
        600.0,
    ) and process.settings.on
    process.configure(900, "off", joined=True)
    assert process.settings.first_timeout == 900.0
    process.configure(0, "off", joined=True)  # the watchdog off: the recorder stays on
    assert (
        process.settings.first_timeout is None
        and not process.settings.watching
        and process.settings.on
    )
    _watch.configure(0, "off")
    assert not process.settings.on


def _call(seq, op="dist.all_reduce", args="float32[4,3]", done=1.0, site="t.py:1", group=(0, 1)):
    return {
        "seq": seq,
        "group": list(group),
        "group_seq": seq,
        "op": op,
        "options": "",
        "args": args,
        "fingerprint": f"{op}|{args}",
        "site": site,
        "issued": float(seq),
        "done": done,
    }


def _rec(k, calls, n=3, reason="timeout", stack=()):
    return {
        "process": k,
        "num_processes": n,
        "reason": reason,
        "time": 100.0,
        "calls": calls,
        "stack": list(stack),
    }


def test_analysis_names_the_process_that_diverged_from_the_others():
    g = (0, 1, 2)
    recs = [
        _rec(
            k,
            [
                _call(1, group=g),
                _call(
                    2,
                    group=g,
                    done=None,
                    site=f"t.py:{9 if k == 2 else 5}",
                    args="float32[8]" if k == 2 else "float32[4,3]",
                ),
            ],
        )
        for k in range(3)
    ]
    (f,) = trace.analyze(recs)
    assert (f.kind, f.seq, f.processes) == ("disagree", 2, (2,))
    assert f.text.startswith("process(es) 2 diverged at call #2 of processes 0-2: ")
    assert "process 2 runs dist.all_reduce(float32[8]) at t.py:9" in f.text


def test_analysis_names_the_process_that_never_issued_the_call_and_where_it_was():
    recs = [
        _rec(0, [_call(1), _call(2, done=None, site="t.py:7")], n=2),
        _rec(1, [_call(1)], n=2, reason="SIGTERM", stack=["/x/loop.py:3 in <module>"]),
    ]
    (f,) = trace.analyze(recs)
    assert (f.kind, f.seq, f.processes) == ("missing", 2, (1,))
    assert f.text == (
        "call #2 of processes 0-1: process(es) 0 issued it (dist.all_reduce(float32[4,3]) at "
        "t.py:7); process 1 never issued it (its last call there was #1, at /x/loop.py:3 in "
        "<module> when it wrote: SIGTERM)."
    )


def test_analysis_of_a_stall_of_every_process_and_of_a_ring_that_dropped_calls():
    recs = [
        _rec(0, [_call(s) for s in range(5, 9)] + [_call(9, done=None)], n=2),
        _rec(1, [_call(s) for s in range(7, 9)] + [_call(9, done=None)], n=2),
    ]
    (f,) = trace.analyze(recs)
    assert (f.kind, f.seq) == ("stalled", 9)
    lines = trace.report(recs)
    assert lines[0].startswith("first: call #9 of processes 0-1 (dist.all_reduce")
    assert lines[-1].startswith("process 1 (timeout): 3 call(s); last completed #8 of 0-1")


def test_analysis_lists_processes_without_a_record_and_the_cli_exit_codes(tmp_path, capsys):
    recs = [_rec(0, [_call(1)], n=3), _rec(2, [_call(1)], n=3)]
    assert "process(es) 1 wrote no record (killed, or never started)." in trace.report(recs)
    # A group member without a record while the others wait: named as the cause.
    g = (0, 1, 2)
    waiting = [_rec(k, [_call(1, group=g), _call(2, group=g, done=None)]) for k in (0, 2)]
    (f,) = trace.analyze(waiting)
    assert (f.kind, f.seq, f.processes) == ("unrecorded", 2, (1,))
    assert f.text == (
        "call #2 of processes 0-2: process(es) 0,2 wait in it (dist.all_reduce(float32[4,3]) "
        "at t.py:1); process(es) 1 wrote no record (killed, or its host is gone)."
    )
    for r in recs:
        (tmp_path / f"process{r['process']}.json").write_text(json.dumps(r))
    assert trace.main([str(tmp_path)]) == 0  # nothing wrong among the records
    assert "flight records of 2 process(es)" in capsys.readouterr().out
    assert trace.main([str(tmp_path / "none")]) == 2


def test_the_thread_ends_and_lets_go_of_arrays_before_the_interpreter_exits(recording):
    # A daemon thread holding jax.Arrays while Python finalizes ends the process with
    # std::terminate (SIGABRT after a passing run); watchdog.stop runs at exit before that.
    from jaxcoll._watch import watchdog

    x = dist.per_rank(lambda r: np.ones((4,), np.float32))
    watchdog.register(dist.all_reduce(x), "held")
    assert watchdog._thread is not None and watchdog._thread.is_alive()
    watchdog.stop()
    assert not watchdog._thread.is_alive() and len(watchdog._pending) == 0
    watchdog.ensure_thread()  # a later call starts it again
    assert watchdog._thread.is_alive()
