"""Checkpoints and host copies across processes, in one 2 x 4 launch
(tests/multihost/workers/ckpt.py):

* a checkpoint written by 2 processes x 4 devices under FSDP restores in this one process,
  under DDP on 8 devices and FSDP on 4, bit-identical, and training goes on as the 2 x 4 run
  did;
* ``Trainer.host_params`` and ``Trainer.to_module`` give every process the whole params,
  equal to a one-process run's;
* a save made on process 0 only raises there at once, naming Checkpointer.save, and the job
  ends on it (no abort inside gloo, no misleading error on process 1);
* a process killed while a save is being committed (tests/multihost/workers/ckpt_lost.py)
  leaves the other one to end with jaxcoll's line naming it (no abort inside orbax or JAX),
  and the restart resumes from the newest committed step and ends as an uninterrupted run;
* a process lost two steps after a save whose commit was slow: fit waited for that commit,
  so the restart resumes from it.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest

from jaxcoll import dp
from tests.helpers import mesh_1d

from ._launch import launch, survivors
from .workers import ckpt_lost_model as lm
from .workers import ckpt_model as cm


def _host(trainer, state, prefix):
    return cm.flat(trainer.host_params(state), prefix)


@pytest.mark.timeout(240)
def test_fsdp_2x4_checkpoints_restore_anywhere_and_host_params_are_whole(tmp_path):
    out, ckpt, solo = tmp_path / "out", tmp_path / "ckpt", tmp_path / "solo"
    job = launch(
        ["--nprocs", "2", "--devices-per-proc", "4"],
        "ckpt.py",
        [str(out), str(ckpt), str(solo)],
        timeout=200,
    )
    err = job.stderr

    # The save on process 0 only: its own clear error, the job ended on it, nothing written.
    assert "process 0: wrote the params" in job.stdout and "process 1: wrote" in job.stdout
    assert "got past the solo save" not in job.stdout, job.stdout[-2000:]
    assert job.returncode == 1, err[-4000:]
    assert re.search(
        r"\[0\] RuntimeError: Checkpointer\.save: process 0 is at save step 4 \(.*solo\), but "
        r"process 1 did not get there within 5s\. Saving and restoring are collective",
        err,
    ), err[-4000:]
    assert "drop the `if process_index == 0` guard" in err
    assert re.search(r"jaxcoll-run: process 0 \(pid \d+\) exited with code 1 first", err), err
    assert not re.search(
        r"EnforceNotMet|is not the same on each process|Check failure|^\[\d\] F\d{4} ", err, re.M
    ), err[-4000:]
    assert survivors(job.token) == []
    assert not [p for p in solo.iterdir() if p.name.isdigit()]

    # host_params and to_module: the whole params, the same on both processes.
    got = [dict(np.load(out / f"p{k}.npz")) for k in (0, 1)]
    assert got[0].keys() == got[1].keys() and len(got[0]) == 3 * 5
    for key in got[0]:
        np.testing.assert_array_equal(got[0][key], got[1][key], err_msg=key)
    for key in (k for k in got[0] if k.startswith("saved/")):
        np.testing.assert_array_equal(got[0]["module/" + key[6:]], got[0][key], err_msg=key)

    # ... equal to one process's run on 8 devices (gloo sums across processes in another
    # order: float32 rounding).
    one = cm.trainer(dp.sync.FSDP(), mesh_1d(8, "data"))
    params, model_state = one.model.init(jax.random.key(0), cm.global_batch(0))
    state = one.init(params, jax.random.key(1), model_state=model_state)
    want = {}
    for s in range(cm.END):
        state, _ = one.step(state, cm.global_batch(s))
        if s + 1 == cm.SAVED_AT:
            want.update(_host(one, state, "saved"))
    want.update(_host(one, state, "end"))
    for key, value in want.items():
        assert np.abs(value).max() > 0
        np.testing.assert_allclose(got[0][key], value, rtol=1e-5, atol=1e-6, err_msg=key)

    # The 2 x 4 FSDP checkpoint restores here, under DDP on 8 devices and FSDP on 4:
    # bit-identical to what the processes held, and the run goes on as theirs did.
    for sync, n in ((dp.sync.DDP(), 8), (dp.sync.FSDP(), 4)):
        trainer = cm.trainer(sync, mesh_1d(n, "data"))
        template = trainer.init(params, jax.random.key(2), model_state=model_state)
        restorer = dp.Checkpointer(ckpt)
        state = restorer.restore_latest(template)
        restorer.close()
        assert int(state.step) == cm.SAVED_AT
        for key, value in _host(trainer, state, "saved").items():
            np.testing.assert_array_equal(value, got[0][key], err_msg=f"{sync} on {n}: {key}")
        for x, t in zip(
            jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(template), strict=True
        ):
            assert x.sharding == t.sharding
        for s in range(cm.SAVED_AT, cm.END):
            state, _ = trainer.step(state, cm.global_batch(s))
        for key, value in _host(trainer, state, "end").items():
            np.testing.assert_allclose(
                value, got[0][key], rtol=1e-5, atol=1e-6, err_msg=f"{sync} on {n}: {key}"
            )


@pytest.mark.timeout(150)
def test_a_process_lost_inside_a_commit_ends_the_other_cleanly_and_the_restart_resumes(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    # --grace 15: the launcher's SIGTERM (10 s after the kill) must not be followed by its
    # SIGKILL before process 0 has said why it stops.
    job = launch(
        ["--nprocs", "2", "--devices-per-proc", "4", "--max-restarts", "1", "--grace", "15"],
        "ckpt_lost.py",
        [str(out), str(ckpt)],
        timeout=130,
    )
    err = job.stderr
    assert job.returncode == 0, err[-4000:]
    assert re.search(r"jaxcoll-run: process 1 \(pid \d+\) was killed by SIGKILL first", err), err
    # Process 0 ends by itself, naming process 1 and the step to resume from.
    assert re.search(
        r"\[0\] jaxcoll: process 0 of 2 stops: Checkpointer: the save of step 6 in .*ckpt "
        r"cannot be committed: process 1 gave no sign of life for \d+s \(killed, or its "
        r"host lost\), so its part of the save is not written\. Step 6 is not a checkpoint; "
        r"the newest committed one is step 4, where a restart resumes\. Exiting with code 1\.",
        err,
    ), err[-4000:]
    assert re.search(r"then process 0 exited with code 1", err), err[-4000:]
    assert not re.search(
        r"SIGABRT|Timed out while waiting for|Check fail|Terminating process|^\[\d\] F\d{4} ",
        err,
        re.M,
    ), err[-4000:]
    assert survivors(job.token) == []

    # The restart resumed at step 5 (after the committed step 4) and ended as a run that was
    # never stopped (one process on 8 devices: gloo sums in another order, float32 rounding).
    got = [dict(np.load(out / f"p{k}.npz")) for k in (0, 1)]
    assert [int(g["first"]) for g in got] == [lm.KILL_AT - lm.EVERY + 1] * 2
    assert [int(g["step"]) for g in got] == [lm.STEPS] * 2
    trainer = dp.Trainer(lm.loss_fn, optax.adam(0.05), mesh=mesh_1d(8, "data"))
    state = trainer.init(jax.tree_util.tree_map(np.asarray, lm.INIT), jax.random.key(0))
    for s in range(lm.STEPS):
        state, _ = trainer.step(state, lm.global_batch(s))
    for k, v in state.params.items():
        np.testing.assert_allclose(got[0][k], np.asarray(v), rtol=1e-5, atol=1e-6, err_msg=k)
        np.testing.assert_array_equal(got[0][k], got[1][k], err_msg=k)


@pytest.mark.timeout(150)
def test_a_save_two_steps_before_a_loss_is_committed_and_the_restart_resumes_there(tmp_path):
    # Process 1's commit of step 4 meets process 0 1.5 s late; process 1 is killed while it
    # fetches the batch after step 6 (milliseconds after the save of step 4 without fit's
    # wait at step 6). The restart resumes from step 4, not 2.
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job = launch(
        ["--nprocs", "2", "--devices-per-proc", "4", "--max-restarts", "1"],
        "ckpt_lost.py",
        [str(out), str(ckpt), "late"],
        timeout=130,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert re.search(r"jaxcoll-run: process 1 \(pid \d+\) was killed by SIGKILL first", job.stderr)
    got = [dict(np.load(out / f"p{k}.npz")) for k in (0, 1)]
    assert [int(g["first"]) for g in got] == [lm.KILL_AT - lm.EVERY + 1] * 2, job.stderr[-3000:]
    assert [int(g["step"]) for g in got] == [lm.STEPS] * 2
    for k in got[0]:
        np.testing.assert_array_equal(got[0][k], got[1][k], err_msg=k)
    assert survivors(job.token) == []
