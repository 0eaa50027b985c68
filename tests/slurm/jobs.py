"""The jobs of ``make test-slurm``, submitted to the cluster that ``tests/slurm/run.sh`` started.

Usage: ``python tests/slurm/jobs.py SCRATCH NODE1`` (a scratch folder, the second node's name)
with ``SLURM_CONF`` pointing at that cluster and ``JAXCOLL_PYTHON`` / ``JAXCOLL_RUN`` at the
venv's python and launcher. Not a pytest file: it needs the cluster, so ``make test`` never
runs it.

First the references, run on this host with ``jaxcoll-run`` and no SLURM; then the jobs:

(a) ``examples/slurm_job.sbatch`` as users submit it (2 nodes x 1 task, each task a
    ``jaxcoll-run --nprocs 1 --devices-per-proc 4``) running every primitive and ``dist`` op
    (tests/multihost/workers/collectives.py): equal to the 1 x 8 run (integers and bools
    exactly, floats to 1e-6: gloo sums in another order) and bit-identical to ``jaxcoll-run``'s
    2 x 4 run; then the same file with no program, which runs examples/multihost_train.py.
(b) ``Trainer.fit`` through the same file (tests/multihost/workers/train.py): final params
    bit-identical to the same 2 x 4 run under ``jaxcoll-run``.
(c) one process SIGKILLed inside an all-reduce (tests/multihost/workers/faults.py): the job
    fails within BOUND_S of the kill, naming the process (launcher) and the task (srun).
(d) ``srun`` alone, no launcher (tests/slurm/srun_direct.sbatch): ``jaxcoll.init`` finds the
    job from SLURM's variables; params bit-identical to (b)'s reference.
(e) (b) with process 1 SIGKILLed at step 6 and the file's default ``JAXCOLL_MAX_RESTARTS=2``:
    the launchers restart, training resumes from its checkpoint, and the final params are
    bit-identical to the uninterrupted run.

(f) ``examples/slurm_elastic.sbatch`` with train.py, node 1 taken away at step 6 (its slurmd,
    slurmstepd and tasks SIGKILLed): the job restarts on node 0 alone, resumes from the
    checkpoint of step 4 (committed before the loss) on 1 x 4 devices and ends equal to the
    2 x 4 run within 1e-5.

(g) ``examples/slurm_job_recoverable.sbatch`` (``jaxcoll-run --recoverable`` on each node) with
    ``dp.Survivor`` (tests/multihost/workers/run_recoverable.py, HSDP replicate=2 x shard=4,
    one replica per node), node 1 taken away at step 3 while its process sleeps there: no
    restart; process 0 goes on alone from step 3 and the job COMPLETES with exit code 0, its
    losses and final params those of one device stepping the same global batches (1e-6). Run
    after (f): it first starts node 1's slurmd again.

``JAXCOLL_SLURM_JOBS=g`` runs job (g) alone.

After every job no process of it is left. Prints one line per job with its time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.multihost._launch import TOKEN_VAR, load_rows, survivors  # noqa: E402

SBATCH = ROOT / "examples" / "slurm_job.sbatch"
SRUN_DIRECT = ROOT / "tests" / "slurm" / "srun_direct.sbatch"
WORKERS = ROOT / "tests" / "multihost" / "workers"
PY = os.environ["JAXCOLL_PYTHON"]
RUN = os.environ["JAXCOLL_RUN"]
if len(sys.argv) != 3:
    sys.exit(f"usage: {sys.argv[0]} SCRATCH NODE1 (see tests/slurm/run.sh)")
SCRATCH, NODE1 = Path(sys.argv[1]), sys.argv[2]
BOUND_S = 60  # a killed process fails the job within this (tests/multihost/test_faults.py)
JOB_TIMEOUT_S = 300
# What make test-slurm overrides in examples/slurm_job.sbatch: CPU nodes, 1 process x 4 devices.
CPU_NODES = ["--gpus-per-node=0", "--cpus-per-task=2", "--time=00:05:00"]
CPU_ENV = {"JAXCOLL_NPROCS": "1", "JAXCOLL_DEVICES_PER_PROC": "4", "JAXCOLL_RUN": RUN}
_ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
}


def say(msg: str) -> None:
    print(f"test-slurm: {msg}", flush=True)


def env_for(token: str, **extra: str) -> dict[str, str]:
    """This environment without any job description (jaxcoll's, JAX's, torchrun's), plus extra."""
    drop = (
        "JAXCOLL_",
        "JAX_COORDINATOR",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "XLA_FLAGS",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "CKPT_DIR",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(JAX_PLATFORMS="cpu", **{TOKEN_VAR: token}, **extra)
    return env


def check(cond: bool, what: str, output: str = "") -> None:
    if not cond:
        raise AssertionError(f"{what}\n--- job output (last 4000 chars) ---\n{output[-4000:]}")


def reference(launcher_args: list[str], program: Path, args: list[str], **extra: str) -> str:
    """Run ``program`` under ``jaxcoll-run`` on this host (no SLURM); return its output."""
    token = uuid.uuid4().hex
    t0 = time.monotonic()
    proc = subprocess.run(
        [RUN, *launcher_args, str(program), *args],
        cwd=ROOT,
        env=env_for(token, **extra),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    check(proc.returncode == 0, f"reference {program.name} {launcher_args} failed", out)
    check(survivors(token) == [], "reference left processes running")
    say(
        f"reference  jaxcoll-run {' '.join(launcher_args)} {program.name}: "
        f"{time.monotonic() - t0:.1f} s"
    )
    return out


@dataclass
class Job:
    id: str
    state: str
    exit_code: int
    seconds: float  # from sbatch to the job leaving RUNNING, as this script saw it
    ended_at: float  # time.monotonic() then
    output: str
    token: str


def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def submit(
    name: str, script: Path, args: list[str], sbatch_opts: list[str], **extra: str
) -> tuple[str, str, float]:
    """sbatch the script; return (job id, token, submit time)."""
    token = uuid.uuid4().hex
    t0 = time.monotonic()
    cmd = [
        "sbatch",
        "--parsable",
        f"--job-name={name}",
        f"--output={SCRATCH / name}.out",
        *sbatch_opts,
        str(script),
        *args,
    ]
    job_id = (
        subprocess.run(
            cmd, cwd=ROOT, env=env_for(token, **extra), capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .split(";")[0]
    )
    return job_id, token, t0


def wait(name: str, job_id: str, token: str, t0: float) -> Job:
    """Poll the job until it ends (``sbatch --wait`` polls with a backoff of up to 2x the job)."""
    ended_at = None
    while True:
        info = job_info(job_id)
        state = info.get("JobState", "")
        if ended_at is None and state not in ("PENDING", "CONFIGURING", "RUNNING"):
            ended_at = time.monotonic()
        if state in _ENDED:
            break
        if time.monotonic() - t0 > JOB_TIMEOUT_S:
            subprocess.run(["scancel", job_id], check=False)
            raise AssertionError(f"job {name} ({job_id}) still {state} after {JOB_TIMEOUT_S} s")
        time.sleep(0.2)
    code = int(info.get("ExitCode", "0:0").split(":")[0])
    log = SCRATCH / f"{name}.out"
    output = log.read_text(errors="replace") if log.exists() else ""
    deadline = time.monotonic() + 30  # slurmstepd ends the tasks just after the job ends
    while survivors(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    check(survivors(token) == [], f"job {name}: processes left after it ended", output)
    return Job(job_id, state, code, ended_at - t0, ended_at, output, token)


def run_job(name: str, script: Path, args: list[str], sbatch_opts: list[str], **extra) -> Job:
    return wait(name, *submit(name, script, args, sbatch_opts, **extra))


def params(out_dir: Path) -> list[dict[str, np.ndarray]]:
    files = sorted(out_dir.glob("p*.npz"))
    loaded = []
    for f in files:
        with np.load(f) as data:
            loaded.append({k: data[k] for k in data.files})
    return loaded


def same_bytes(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
        for k in a
    )


def stack(rows: dict[int, np.ndarray]) -> np.ndarray:
    return np.stack([rows[r] for r in sorted(rows)])


def job_a(ref_1x8: dict, ref_2x4: dict, loss_line: str) -> None:
    out = SCRATCH / "a_collectives"
    job = run_job(
        "a_collectives", SBATCH, [str(WORKERS / "collectives.py"), str(out)], CPU_NODES, **CPU_ENV
    )
    check(
        job.state == "COMPLETED" and job.exit_code == 0,
        f"(a) job {job.id} ended {job.state}, exit code {job.exit_code}",
        job.output,
    )
    for p in (0, 1):
        check(
            f"[{p}] process {p}: saved" in job.output, f"(a) no output from process {p}", job.output
        )
    got = load_rows(str(out))
    names = sorted(k for k in ref_1x8 if not k.startswith("proc/"))
    check(len(names) > 150, f"(a) only {len(names)} results in the 1 x 8 reference")
    check(sorted(got) == sorted(ref_2x4), "(a) SLURM and jaxcoll-run 2 x 4 saved other results")
    for name in names:
        check(sorted(got[name]) == sorted(ref_1x8[name]), f"(a) {name}: other rows than 1 x 8")
        a, b = stack(got[name]), stack(ref_1x8[name])
        check(a.dtype == b.dtype and a.shape == b.shape, f"(a) {name}: dtype/shape differ")
        if a.dtype.kind in "fc":
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=f"(a) {name}")
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"(a) {name}")
    for name in got:
        for row in got[name]:
            check(
                got[name][row].tobytes() == ref_2x4[name][row].tobytes(),
                f"(a) {name}@{row} differs from jaxcoll-run's 2 x 4 run",
            )
    for p in (0, 1):
        check(int(got["proc/process_count"][p]) == 2, "(a) process_count is not 2")
        check(
            got["proc/local_ranks_world"][p].tolist() == list(range(4 * p, 4 * p + 4)),
            f"(a) process {p} holds ranks {got['proc/local_ranks_world'][p].tolist()}",
        )
    say(
        f"(a) sbatch examples/slurm_job.sbatch collectives.py, 2 nodes x 1 x 4: "
        f"{len(names)} results == 1 x 8, bit-identical to jaxcoll-run 2 x 4: "
        f"PASS {job.seconds:.1f} s"
    )

    # The same file with no program: examples/multihost_train.py, as docs/multihost.md says.
    job = run_job(
        "a_default", SBATCH, [], CPU_NODES, CKPT_DIR=str(SCRATCH / "a_default_ckpt"), **CPU_ENV
    )
    check(
        job.state == "COMPLETED" and job.exit_code == 0,
        f"(a) default program: job {job.id} ended {job.state}",
        job.output,
    )
    line = next((ln for ln in job.output.splitlines() if "loss" in ln), "")
    check(
        line == loss_line,
        f"(a) default program printed {line!r}, jaxcoll-run {loss_line!r}",
        job.output,
    )
    say(
        f"(a) sbatch examples/slurm_job.sbatch (multihost_train.py): {line!r}: "
        f"PASS {job.seconds:.1f} s"
    )


def job_b(ref_train: list[dict]) -> None:
    out = SCRATCH / "b_train"
    job = run_job(
        "b_train",
        SBATCH,
        [str(WORKERS / "train.py"), str(out), str(SCRATCH / "b_ckpt"), "0"],
        CPU_NODES,
        **CPU_ENV,
    )
    check(
        job.state == "COMPLETED" and job.exit_code == 0,
        f"(b) job {job.id} ended {job.state}, exit code {job.exit_code}",
        job.output,
    )
    got = params(out)
    check(len(got) == 2, f"(b) {len(got)} params files, expected 2", job.output)
    for p in got:
        check(int(p["step"]) == 12, f"(b) finished at step {int(p['step'])}, not 12")
        check(same_bytes(p, ref_train[0]), "(b) params differ from jaxcoll-run's 2 x 4 run")
    say(
        f"(b) sbatch examples/slurm_job.sbatch train.py: Trainer.fit params bit-identical to "
        f"jaxcoll-run 2 x 4: PASS {job.seconds:.1f} s"
    )


def job_c() -> None:
    out = SCRATCH / "c_fault"
    out.mkdir()
    job_id, token, t0 = submit(
        "c_fault",
        SBATCH,
        [str(WORKERS / "faults.py"), str(out), "loop"],
        CPU_NODES,
        **{**CPU_ENV, "JAXCOLL_MAX_RESTARTS": "0"},
    )
    deadline = time.monotonic() + 120
    while not all((out / f"loop{k}").exists() for k in (0, 1)):
        if time.monotonic() > deadline or job_info(job_id).get("JobState") in _ENDED:
            subprocess.run(["scancel", job_id], check=False)
            raise AssertionError("(c) the job never reached its collective loop")
        time.sleep(0.2)
    victim = int((out / "pid1").read_text())
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)  # process 1, on the second node, inside an all-reduce
    job = wait("c_fault", job_id, token, t0)
    after = job.ended_at - killed_at
    # The job's exit code is the highest of its tasks': 137 (node 1's launcher), or 143 when
    # srun's SIGTERM made node 0's launcher exit with 128 + SIGTERM.
    check(
        job.state == "FAILED" and job.exit_code in (137, 143),
        f"(c) job ended {job.state}, exit code {job.exit_code}",
        job.output,
    )
    check(
        after < BOUND_S,
        f"(c) the job ended {after:.1f} s after the kill (bound {BOUND_S} s)",
        job.output,
    )
    named = f"jaxcoll-run: process 1 (pid {victim}) was killed by SIGKILL first"
    check(named in job.output, f"(c) the launcher did not say {named!r}", job.output)
    task = f"srun: error: {NODE1}: task 1: Exited with exit code {128 + signal.SIGKILL}"
    check(task in job.output, f"(c) srun did not say {task!r}", job.output)
    say(
        f"(c) process 1 SIGKILLed in an all-reduce: job FAILED (exit code {job.exit_code}) "
        f"{after:.1f} s after the kill (bound {BOUND_S} s), naming it: '{named}', '{task}': "
        f"PASS {job.seconds:.1f} s"
    )


def job_d(ref_train: list[dict]) -> None:
    out = SCRATCH / "d_srun"
    job = run_job(
        "d_srun",
        SRUN_DIRECT,
        [str(WORKERS / "train.py"), str(out), str(SCRATCH / "d_ckpt"), "0"],
        ["--time=00:05:00"],
        JAXCOLL_PYTHON=PY,
        JAX_NUM_CPU_DEVICES="4",
    )
    check(
        job.state == "COMPLETED" and job.exit_code == 0,
        f"(d) job {job.id} ended {job.state}, exit code {job.exit_code}",
        job.output,
    )
    got = params(out)
    check(len(got) == 2, f"(d) {len(got)} params files, expected 2", job.output)
    for p in got:
        check(same_bytes(p, ref_train[0]), "(d) params differ from jaxcoll-run's 2 x 4 run")
    say(
        f"(d) srun python train.py (no launcher; init from SLURM's variables): params "
        f"bit-identical to jaxcoll-run 2 x 4: PASS {job.seconds:.1f} s"
    )


def job_e(ref_train: list[dict]) -> None:
    out, ckpt = SCRATCH / "e_restart", SCRATCH / "e_ckpt"
    job = run_job(
        "e_restart",
        SBATCH,
        [str(WORKERS / "train.py"), str(out), str(ckpt), "6"],
        CPU_NODES,
        **CPU_ENV,
    )  # the file's own JAXCOLL_MAX_RESTARTS (2)
    check(
        job.state == "COMPLETED" and job.exit_code == 0,
        f"(e) job {job.id} ended {job.state}, exit code {job.exit_code}",
        job.output,
    )
    check(
        "jaxcoll-run: process 1 (pid" in job.output and "was killed by SIGKILL first" in job.output,
        "(e) process 1 was not killed",
        job.output,
    )
    restarts = job.output.count("jaxcoll-run: restarting all 1 process(es) (restart 1 of 2)")
    check(restarts >= 1, "(e) no launcher restarted", job.output)
    check((ckpt / "12").is_dir(), "(e) no checkpoint of step 12", job.output)
    got = params(out)
    check(len(got) == 2, f"(e) {len(got)} params files, expected 2", job.output)
    for p in got:
        check(same_bytes(p, ref_train[0]), "(e) params differ from the uninterrupted run")
    say(
        f"(e) process 1 SIGKILLed at step 6, default --max-restarts 2: {restarts} node(s) "
        f"restarted, resumed from the checkpoint, params bit-identical to the uninterrupted "
        f"run: PASS {job.seconds:.1f} s"
    )


def _take_node_away(node: str) -> list[int]:
    """What a dead node does to a job: its slurmd, its job steps' slurmstepd and its tasks
    end at once (SIGKILL, by pid: every "node" of this cluster is a process tree on this
    host). Returns the pids killed."""
    victims = []
    for path in Path("/proc").glob("[0-9]*"):
        pid = int(path.name)
        try:
            cmd = (path / "cmdline").read_bytes().split(b"\0")
            env = (path / "environ").read_bytes().split(b"\0")
            stat = (path / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        daemon = cmd[:1] and cmd[0].endswith(b"slurmd") and node.encode() in cmd
        task = f"SLURMD_NODENAME={node}".encode() in env and cmd[:1] != [b""]
        if daemon or task:
            victims.append(pid)
            if task:
                parent = int(stat[1])  # the task's slurmstepd (or a task of the same step)
                victims.append(parent)
    killed = []
    for pid in dict.fromkeys(victims):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name in ("slurmctld", "munged") or pid in (os.getpid(), os.getppid()):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    return killed


def job_f(ref_train: list[dict]) -> None:
    """(f) examples/slurm_elastic.sbatch: node 1 is lost at step 6; the job goes on alone."""
    out, ckpt = SCRATCH / "f_elastic", SCRATCH / "f_ckpt"
    job_id, token, t0 = submit(
        "f_elastic",
        ROOT / "examples" / "slurm_elastic.sbatch",
        [str(WORKERS / "train.py"), str(out), str(ckpt), "6", "PAUSE"],
        CPU_NODES,
        **{**CPU_ENV, "JAXCOLL_PROBE_S": "20"},
    )
    deadline = time.monotonic() + 180
    while not (out / "paused1").exists():  # process 1 (node 1) sleeps at step 6
        if time.monotonic() > deadline or job_info(job_id).get("JobState") in _ENDED:
            subprocess.run(["scancel", job_id], check=False)
            raise AssertionError("(f) process 1 never reached step 6")
        time.sleep(0.2)
    killed = _take_node_away(NODE1)
    check(bool(killed), f"(f) found nothing of node {NODE1} to take away")
    job = wait("f_elastic", job_id, token, t0)
    check(
        job.state == "COMPLETED" and job.exit_code == 0,
        f"(f) job {job.id} ended {job.state}, exit code {job.exit_code}",
        job.output,
    )
    node0 = NODE1.rsplit("-", 1)[0]
    check(
        "slurm_elastic: step 0 failed" in job.output
        and f"slurm_elastic: step 1 on 1 node(s): {node0} " in job.output,
        f"(f) the job did not restart on {node0} alone",
        job.output,
    )
    got = params(out)
    check(len(got) == 1, f"(f) {len(got)} params files, expected 1", job.output)
    check(int(got[0]["step"]) == 12, "(f) did not finish at step 12", job.output)
    resumed = re.search(r"process 0: finished at step 12 on 4 devices, (\d+) steps", job.output)
    # From step 4: fit waits for each save's commit two steps after it, so the save of step 4
    # is committed before process 1 sleeps at step 6 (8 steps in the restarted run).
    check(
        resumed is not None and int(resumed.group(1)) == 8,
        "(f) did not resume from the checkpoint of step 4 (committed before the loss at step 6)",
        job.output,
    )
    for k in ("w", "b", "v"):
        np.testing.assert_allclose(got[0][k], ref_train[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
    say(
        f"(f) examples/slurm_elastic.sbatch, node {NODE1} taken away at step 6 (slurmd, its "
        f"step and tasks killed): restarted on {node0} alone, {resumed.group(1)} steps from "
        f"the checkpoint on 1 x 4 devices, params equal to the 2 x 4 run within 1e-5: "
        f"PASS {job.seconds:.1f} s"
    )


def _node_back(node: str) -> None:
    """Start ``node``'s slurmd again (after (f) took it away) and wait until it is idle."""
    if _slurmd_running(node) and _node_state(node) == "idle":
        return
    log = open(SCRATCH / f"slurmd-{node}-again.out", "w")  # noqa: SIM115 - the daemon keeps it
    subprocess.Popen(
        ["slurmd", "-D", "-N", node, "-f", os.environ["SLURM_CONF"]],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # ended by run.sh's last sweep (it carries TEST_SLURM_RUN)
    deadline = time.monotonic() + 90
    while _node_state(node) != "idle":
        if time.monotonic() > deadline:
            raise AssertionError(f"(g) node {node} not idle again: {_node_state(node)!r}")
        if _node_state(node) in ("down", "drain"):  # it answers again, marked down
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        time.sleep(0.5)


def _slurmd_running(node: str) -> bool:
    for path in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (path / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd[:1] and cmd[0].endswith(b"slurmd") and node.encode() in cmd:
            return True
    return False


def _node_state(node: str) -> str:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True
    ).stdout
    return out.strip()  # "idle", or "idle*" / "down*" for a node that does not respond


def job_g() -> None:
    """(g) examples/slurm_job_recoverable.sbatch: node 1 is lost at step 3; no restart."""
    from tests.multihost.test_replica_loss import _oracle

    _node_back(NODE1)
    out = SCRATCH / "g_recoverable"
    out.mkdir()
    kill_step, steps = 3, 8
    job_id, token, t0 = submit(
        "g_recoverable",
        ROOT / "examples" / "slurm_job_recoverable.sbatch",
        [str(WORKERS / "run_recoverable.py"), str(out), str(kill_step), str(steps)]
        + ["1", "2", "4", "pause"],
        CPU_NODES,
        **{**CPU_ENV, "JAXCOLL_COLLECTIVE_TIMEOUT": "5"},
    )
    deadline = time.monotonic() + 180
    while not (out / "killed").exists():  # process 1 (node 1) sleeps at step 3
        if time.monotonic() > deadline or job_info(job_id).get("JobState") in _ENDED:
            subprocess.run(["scancel", job_id], check=False)
            raise AssertionError("(g) process 1 never reached step 3")
        time.sleep(0.2)
    lost_at = time.monotonic()
    killed = _take_node_away(NODE1)
    check(bool(killed), f"(g) found nothing of node {NODE1} to take away")
    job = wait("g_recoverable", job_id, token, t0)
    check(
        job.state == "COMPLETED" and job.exit_code == 0,
        f"(g) job {job.id} ended {job.state}, exit code {job.exit_code}",
        job.output,
    )
    check("slurm_recoverable: node 0's launcher exited 0." in job.output, "(g) node 0", job.output)
    check("restart" not in job.output.replace("--max-restarts", ""), "(g) restarted", job.output)
    events = json.loads((out / "p0.json").read_text())
    replicas = [s[4] for s in events["steps"]]
    check(
        [s[0] for s in events["steps"]] == list(range(steps))
        and replicas == [2] * kill_step + [1] * (steps - kill_step),
        f"(g) process 0's steps {events['steps']}",
        job.output,
    )
    with np.load(out / "p0.npz") as data:
        init = {k[5:]: data[k] for k in data.files if k.startswith("init/")}
        batches = [{n: data[f"batch/{i}/{n}"] for n in ("x", "y", "id")} for i in range(steps)]
        final = {k[6:]: data[k] for k in data.files if k.startswith("final/")}
    expect, losses = _oracle(init, batches)
    np.testing.assert_allclose([s[2] for s in events["steps"]], losses, rtol=1e-5, atol=1e-6)
    for k, v in expect.items():
        np.testing.assert_allclose(final[k], v, rtol=0, atol=1e-6, err_msg=f"(g) {k}")
    resumed = events["steps"][kill_step][3] - events["steps"][kill_step - 1][3]
    say(
        f"(g) examples/slurm_job_recoverable.sbatch, node {NODE1} taken away at step "
        f"{kill_step}: no restart, process 0 went on alone (step {kill_step} done "
        f"{resumed:.1f} s after step {kill_step - 1}; job ended {job.ended_at - lost_at:.1f} s "
        f"after the loss), COMPLETED exit 0, params equal to one device's: "
        f"PASS {job.seconds:.1f} s"
    )


def main() -> None:
    t0 = time.monotonic()
    if os.environ.get("JAXCOLL_SLURM_JOBS") == "g":  # (g) alone: it needs no reference
        job_g()
        say(f"job (g) passed in {time.monotonic() - t0:.1f} s")
        return
    ref = SCRATCH / "ref"
    reference(
        ["--nprocs", "1", "--devices-per-proc", "8"],
        WORKERS / "collectives.py",
        [str(ref / "c1x8")],
    )
    reference(
        ["--nprocs", "2", "--devices-per-proc", "4"],
        WORKERS / "collectives.py",
        [str(ref / "c2x4")],
    )
    reference(
        ["--nprocs", "2", "--devices-per-proc", "4"],
        WORKERS / "train.py",
        [str(ref / "t2x4"), str(ref / "t2x4_ckpt"), "0"],
    )
    out = reference(
        ["--nprocs", "2", "--devices-per-proc", "4"],
        ROOT / "examples" / "multihost_train.py",
        [],
        CKPT_DIR=str(ref / "mh_ckpt"),
    )
    loss_line = next(ln for ln in out.splitlines() if "loss" in ln)
    ref_train = params(ref / "t2x4")
    check(len(ref_train) == 2 and same_bytes(*ref_train), "reference: processes disagree")
    job_a(load_rows(str(ref / "c1x8")), load_rows(str(ref / "c2x4")), loss_line)
    job_b(ref_train)
    job_c()
    job_d(ref_train)
    job_e(ref_train)
    job_f(ref_train)  # it takes node 1 away
    job_g()  # last: it starts node 1 again, then takes it away
    say(f"all jobs passed in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
