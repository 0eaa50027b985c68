"""The dp examples run as scripts (they set their own device count) and print what they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_train_digits_short_run(tmp_path):
    stdout = _run(
        "examples/train_digits.py", "--steps", "60", "--no-progress", "--out", str(tmp_path)
    )
    assert "8 devices, 1437 train / 360 test images" in stdout
    accuracy = float(re.search(r"test accuracy: ([\d.]+)%", stdout).group(1))
    assert accuracy > 80.0  # 60 steps; the full 400-step run reaches > 95%
    png = tmp_path / "train_digits_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resnet_digits_flax_imagenet_recipe():
    """ResNet + SyncBatchNorm + warmup-cosine SGD + L2 in the loss + EMA, 20 epochs."""
    stdout = _run("examples/resnet_digits.py")
    assert "8 devices, 1347 train / 450 test images" in stdout
    evals = re.findall(r"^step +(\d+) .*\|\s+test loss [\d.]+ acc +([\d.]+)%", stdout, re.M)
    assert [int(s) for s, _ in evals] == list(range(10, 201, 10))  # every epoch
    lrs = [float(v) for v in re.findall(r" lr ([\d.]+) ", stdout)]
    assert max(lrs) > 0.15 and lrs[0] < 0.1 and lrs[-1] < 0.01  # warm-up, then cosine decay
    assert float(re.search(r"^test accuracy: ([\d.]+)%", stdout, re.M).group(1)) > 95.0
    assert float(re.search(r"test accuracy \(EMA params\): ([\d.]+)%", stdout).group(1)) > 95.0


def test_nnx_cnn_digits_dropout_and_round_trip():
    """flax's nnx MNIST CNN (BatchNorm, Dropout with nnx.Rngs, called with rngs), 20 epochs."""
    stdout = _run("examples/nnx_cnn_digits.py")
    assert "8 devices, 1347 train / 450 test images" in stdout
    assert len(re.findall(r"^epoch +\d+ \(step +\d+\): test loss", stdout, re.M)) == 20
    got = float(re.search(r"^test accuracy: ([\d.]+)%", stdout, re.M).group(1))
    direct = float(re.search(r"to_module\(state\), run directly: ([\d.]+)%", stdout).group(1))
    assert got > 95.0 and direct == got  # the returned nnx module is the trained model


def test_average_gradients_verdicts():
    stdout = _run("examples/04_average_gradients.py")
    verdicts = dict(re.findall(r"^(.+?)\s+[\d.]+\s+[\d.e+-]+\s+\w+\s+(RIGHT|WRONG)$", stdout, re.M))
    assert verdicts == {
        "1. all_reduce(SUM) / n, naive port": "WRONG",
        "1. all_reduce(SUM) / n, params varying": "RIGHT",
        "2. clone, all_reduce(SUM) / n": "RIGHT",
        "3. sub-group average (4 of 8)": "WRONG",
        "jaxcoll dp.mean_gradients": "RIGHT",
    }
    assert re.search(r"naive port\s+8\.0000", stdout)
