"""Run every seed example as a user would and check the values it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def lines_matching(out: str, pattern: str) -> list[str]:
    return [m.group(1) for m in re.finditer(pattern, out)]


@pytest.fixture(scope="module")
def out01():
    return run_example("01_all_reduce.py")


def test_01_scalars_sum_to_three(out01):
    assert lines_matching(out01, r"Rank \d: Before all_reduce - Value = (\[.*\])") == [
        "[1.0]",
        "[2.0]",
    ]
    assert lines_matching(out01, r"Rank \d: After all_reduce - Value = (\[.*\])") == [
        "[3.0]",
        "[3.0]",
    ]


def test_01_tensors_and_max(out01):
    after = lines_matching(out01, r"Rank \d: After all_reduce - Tensor = (\[.*\])")
    assert after == [str([[3.0] * 3] * 3)] * 2
    after_max = lines_matching(out01, r"Rank \d: After all_reduce\(MAX\) - Tensor = (\[.*\])")
    assert after_max == ["[2.0, 4.0, 6.0]"] * 2


def test_02_reduce_leaves_other_arrays_alone():
    out = run_example("02_reduce.py")
    first = lines_matching(out, r"(Rank \d: x = .*)")
    assert first == [
        "Rank 0: x = [1, 2, 3], y = [2, 3, 4], reduce result = [11, 22, 33]",
        "Rank 1: x = [10, 20, 30], y = [11, 21, 31], reduce result = [10, 20, 30]",
    ]
    shared = lines_matching(out, r"(Rank \d: shared .*)")
    assert all("shared x = [1.0, 2.0, 3.0], shared y = [4.0, 5.0, 6.0]" in s for s in shared)
    assert shared[0].endswith("reduce result = [2.0, 4.0, 6.0]")
    assert shared[1].endswith("reduce result = [1.0, 2.0, 3.0]")
    async_lines = lines_matching(out, r"(Rank \d: after async reduce .*)")
    assert async_lines[0] == (
        "Rank 0: after async reduce x = [1, 2, 3], y = [4, 5, 6], reduce result = [11, 22, 33]"
    )
    assert async_lines[1].endswith("y = [13, 23, 33], reduce result = [10, 20, 30]")


def test_03_every_torch_primitive():
    out = run_example("03_collectives.py")

    def rows(label):
        return lines_matching(out, rf"Rank \d {re.escape(label)}: (\[.*\])")

    assert rows("has data after broadcast") == ["[1.0]"] * 4
    assert rows("final tensor after all_reduce") == ["[10.0]"] * 4
    assert rows("after reduce(dst=0)") == ["[10.0]", "[2.0]", "[3.0]", "[4.0]"]
    assert rows("received tensor after scatter") == ["[1.0]", "[2.0]", "[3.0]", "[4.0]"]
    assert (
        rows("gather list after gather(dst=0)")
        == ["[[1.0], [2.0], [3.0], [4.0]]"] + ["[[0.0], [0.0], [0.0], [0.0]]"] * 3
    )
    assert rows("list after all_gather") == ["[[1.0], [2.0], [3.0], [4.0]]"] * 4
    assert rows("after send(0 -> 1)/recv") == ["[42.0]", "[42.0]", "[-1.0]", "[-1.0]"]
    assert rows("after a ring shift") == ["[4.0]", "[1.0]", "[2.0]", "[3.0]"]
    assert rows("after all_reduce(PRODUCT)") == ["[24.0]"] * 4
    assert rows("after all_reduce(BXOR) of rank+1 as int") == ["[4]"] * 4


def test_05_moe_dispatch_equals_dense():
    out = run_example("05_moe_dispatch.py")
    sends = lines_matching(out, r"rank \d sends (\[.*?\]) tokens")
    assert len(sends) == 4 and len(set(sends)) > 1  # uneven counts per destination
    assert "MoE equal to dense: True" in out
    err = float(re.search(r"max abs difference ([\d.e+-]+)", out).group(1))
    assert err < 1e-5
    assert "rows as torch's: True" in out


def test_06_pipeline_equals_single_device_training():
    out = run_example("06_pipeline.py")
    assert "pipeline equal to single-device training (1e-5): True" in out
    assert "bubble fraction (S-1)/(M+S-1) = 3/11 = 0.273" in out
    losses = [
        (float(a), float(b))
        for a, b in re.findall(r"pipeline loss ([\d.]+)\s+single-device loss ([\d.]+)", out)
    ]
    assert len(losses) == 4 and losses[-1][0] < losses[0][0]  # it trains
    assert all(abs(a - b) <= 1e-5 for a, b in losses)


def test_07_tensor_parallel_equals_dense():
    out = run_example("07_tensor_parallel.py")
    assert out.count("tensor-parallel block equal to dense") == 2
    assert "equal to dense (all_reduce): True" in out
    assert "equal to dense (sequence-parallel (all_gather + reduce_scatter)): True" in out
    assert "collectives {'all_reduce': 1}" in out
    assert "collectives {'all_gather': 1, 'reduce_scatter': 1}" in out
