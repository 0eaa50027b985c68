"""dp.Trainer across processes: 2 x 4 reaches the 1 x 8 params (DDP, FSDP and HSDP with the
replicas across processes), the GPT example in a 3-D layout (FSDP x tensor x pipeline)
reaches the single-device params, and a job survives a SIGKILL.

Each process feeds only its own rows of every global batch
(``jax.make_array_from_process_local_data``; tests/multihost/workers/train.py).
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from ._launch import ROOT, launch, survivors

KEYS = ("w", "b", "v")


def _train(tmp_path, name, launcher_args, kill_at=0, sig="KILL", strategy="ddp"):
    out, ckpt = tmp_path / name, tmp_path / f"{name}_ckpt"
    job = launch(
        launcher_args, "train.py", [str(out), str(ckpt), str(kill_at), sig, strategy], timeout=200
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert survivors(job.token) == []
    files = sorted(out.glob("p*.npz"))
    params = [dict(np.load(f)) for f in files]
    for p in params:
        assert int(p["step"]) == 12
    return job, params


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The 1 x 8 run (plain DDP) both tests compare with."""
    _, (params,) = _train(
        tmp_path_factory.mktemp("single"), "1x8", ["--nprocs", "1", "--devices-per-proc", "8"]
    )
    return params


@pytest.mark.timeout(400)
def test_trainer_2x4_matches_1x8_and_resumes_after_a_kill(tmp_path, single):
    _, two = _train(tmp_path, "2x4", ["--nprocs", "2", "--devices-per-proc", "4"])
    job, resumed = _train(
        tmp_path,
        "2x4_killed",
        ["--nprocs", "2", "--devices-per-proc", "4", "--max-restarts", "1"],
        kill_at=6,
    )
    job_t, preempted = _train(
        tmp_path,
        "2x4_term",
        ["--nprocs", "2", "--devices-per-proc", "4", "--max-restarts", "1"],
        kill_at=6,
        sig="TERM",
    )
    assert len(two) == len(resumed) == len(preempted) == 2
    # SIGTERM: both processes stopped after the same step, saved it, exited 143, resumed.
    assert "received SIGTERM; the training loop will stop at a step boundary" in job_t.stderr
    saved = {int(k) for k in re.findall(r"SIGTERM: saved a checkpoint at step (\d+)", job_t.stderr)}
    assert len(saved) == 1, job_t.stderr[-4000:]  # both processes, the same step
    (at,) = saved
    assert 6 <= at < 12, at  # the step SIGTERM arrived at (while batch 6 was being built)
    assert "exited with code 143 first" in job_t.stderr
    assert "restarting all 2 process(es) (restart 1 of 1)" in job_t.stderr
    # The restart resumed from that step's checkpoint, not from an earlier periodic one
    # (every 4 steps): without the preemption save it would start again at step 4 (or 8).
    assert f"process 0: finished at step 12 on 8 devices, {12 - at} steps in this run" in (
        job_t.stdout
    ), (at, job_t.stdout[-2000:])
    # The run was really killed, and restarted once with its checkpoints.
    assert "process 1 (pid" in job.stderr and "was killed by SIGKILL first" in job.stderr
    assert "restarting all 2 process(es) (restart 1 of 1)" in job.stderr
    assert (tmp_path / "2x4_killed_ckpt" / "12").is_dir()
    for k in KEYS:
        assert np.abs(single[k] - single[k].mean()).max() > 0  # trained to something non-trivial
        for p in two:
            # Same math, different reduction order (gloo across processes): float32 rounding.
            np.testing.assert_allclose(p[k], single[k], rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_array_equal(p[k], two[0][k])  # both processes agree exactly
        for p in resumed + preempted:
            np.testing.assert_array_equal(p[k], two[0][k], err_msg=k)  # bit-identical resume


@pytest.mark.timeout(300)
def test_a_process_that_fails_for_good_is_left_out_and_the_job_ends_equal(tmp_path, single):
    # --nprocs 1:2 --max-restarts 1: process 1 (devices 4-7) raises at step 6 in every run.
    # The job restarts both once, then goes on without it: one process on devices 0-3
    # restores the newest checkpoint (saved on 8 devices) onto its 4 and trains the same
    # global batches (8 examples per device instead of 4) to the end.
    job, (params,) = _train(
        tmp_path,
        "elastic",
        ["--nprocs", "1:2", "--devices-per-proc", "4", "--max-restarts", "1"],
        kill_at=6,
        sig="FAIL",
    )
    assert (
        job.stderr.count("[1] RuntimeError: train.py: devices 4-7 fail for good at step 6\n") == 2
    )
    assert "restarting all 2 process(es) (restart 1 of 1)" in job.stderr
    assert (
        "process 1 failed 2 time(s) in a row; going on without it (its devices, local slot 1): "
        "restarting 1 process(es) (--nprocs 1:2)" in job.stderr
    ), job.stderr[-3000:]
    # It resumed from step 4's checkpoint (taken on 8 devices), not from scratch.
    assert "process 0: finished at step 12 on 4 devices, 8 steps in this run" in job.stdout
    for k in KEYS:
        np.testing.assert_allclose(params[k], single[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.timeout(300)
def test_fsdp_2x4_matches_1x8_and_resumes_after_a_kill(tmp_path, single):
    # sync=dp.sync.FSDP(): every leaf split over the 8 devices, i.e. over both processes; the
    # result is the plain 1 x 8 run's up to float rounding.
    job, resumed = _train(
        tmp_path,
        "2x4_killed",
        ["--nprocs", "2", "--devices-per-proc", "4", "--max-restarts", "1"],
        kill_at=6,
        strategy="fsdp",
    )
    assert "restarting all 2 process(es) (restart 1 of 1)" in job.stderr
    assert len(resumed) == 2
    for k in KEYS:
        assert np.abs(single[k] - single[k].mean()).max() > 0
        for p in resumed:
            np.testing.assert_allclose(p[k], single[k], rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_array_equal(p[k], resumed[0][k])


@pytest.mark.timeout(200)
def test_hsdp_with_replicas_across_processes_matches_1x8(tmp_path, single):
    # dp.Layout(replicate="replica", shard="shard") (FSDP over "shard": HSDP) on a (replica 2,
    # shard 4) mesh whose rows are the two processes: params split over each process's 4
    # devices, replicated across processes, the gradient slices summed across them (HSDP
    # across nodes).
    _, two = _train(tmp_path, "hsdp", ["--nprocs", "2", "--devices-per-proc", "4"], strategy="hsdp")
    assert len(two) == 2
    for k in KEYS:
        for p in two:
            np.testing.assert_allclose(p[k], single[k], rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_array_equal(p[k], two[0][k])


@pytest.mark.timeout(200)
def test_the_gpt_example_across_processes_equals_one_device(tmp_path):
    # examples/gpt.py --tiny in the layout FSDP 2 x tensor 2 x pipeline 2 by 1F1B under
    # jaxcoll-run; the layout's mesh puts the pipeline axis outermost, so the stages' sends
    # cross the two processes and the shard and tensor axes stay inside each: the params
    # equal the example's single-device run (in this process) after the same steps.
    from tests.test_gpt import STEPS, TOL, _flat, _max_rel, _train

    out = tmp_path / "params.npz"
    args = ["--tiny", "--layout", "fsdp2xtp2xpp2:1f1b2"]
    args += ["--steps", str(STEPS), "--out", str(out)]
    job = launch(
        ["--nprocs", "2", "--devices-per-proc", "4"],
        os.path.join(ROOT, "examples", "gpt.py"),
        args,
        timeout=150,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert survivors(job.token) == []
    assert "fsdp2xtp2xpp2:1f1b2: mesh {'pipeline': 2, 'shard': 2, 'tensor': 2}" in job.stdout
    single, _ = _train("single")
    assert _max_rel(dict(np.load(out)), _flat(single)) <= TOL


@pytest.mark.timeout(120)
def test_multihost_example_runs_under_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_DIR", str(tmp_path / "ckpt"))
    job = launch(
        ["--nprocs", "2", "--devices-per-proc", "4"],
        os.path.join(ROOT, "examples", "multihost_train.py"),
        [],
        timeout=100,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    line = next(ln for ln in job.stdout.splitlines() if "loss" in ln)
    assert line.startswith("[0] 2 process(es) x 4 devices: loss ")
    first, last = (float(v) for v in line.split("loss ")[1].split(" after")[0].split(" -> "))
    assert last < first / 3
    assert survivors(job.token) == []
