"""Losing a data replica without a restart: what JAX 0.10.2 (CPU, gloo) does, measured.

    .venv/bin/python benchmarks/replica_loss.py                      # 2 x 4, every scenario
    .venv/bin/python benchmarks/replica_loss.py --procs 4 --devs 2   # 4 x 2
    .venv/bin/python benchmarks/replica_loss.py --scenarios kill1 --heartbeat 10

What jaxcoll builds on these facts: :class:`jaxcoll.dp.Survivor` (a Trainer that drops a
lost data replica and re-runs the step, and admits a replacement), measured by
``tests/multihost/test_replica_loss.py``.

Every scenario is a fresh job of ``--procs`` processes with ``--devs`` simulated CPU devices
each, started by this script (one session per process, every one killed at the end), every
process calling ``jax.config.update("jax_enable_recoverability", True)`` and then
``jax.distributed.initialize(..., heartbeat_timeout_seconds=--heartbeat)``, gloo between them,
the XLA:CPU flags ``jaxcoll-run`` sets except ``--xla_cpu_collective_timeout_seconds``
(``--collective-timeout``; jaxcoll-run sets a week). The step is a jitted ``shard_map`` over
a mesh of every device (axis ``data``): ``w <- w - 0.1 * pmean(g, "data")``, ``w`` (16
float32) replicated, device ``r`` of ``n`` contributing ``g = (i + 1) + r`` at step ``i``.

Scenarios (the victim kills itself with SIGKILL at step ``--kill-step``, after writing the
time):

* ``kill1``: the last process dies while the others loop on steps. The survivors record how
  their next step ends, then call ``multihost_utils.live_devices(jax.devices())`` until it
  leaves the victim out, read their old arrays, build a ``Mesh`` of the live devices, re-create
  ``w`` from their local shard and run 4 steps on it (checked against NumPy), then try one
  collective on the old mesh.
* ``detect``: the victim finishes step ``k`` with the others, sleeps 1 s and dies; the others
  enter ``live_devices`` right after step ``k`` (before the death), so the call's duration
  shows whether it waits, and its end minus the kill time is the detection latency.
* ``kill0``: process 0 (the coordination service's host) dies; what the others do.
* ``straggle`` (not in the default list): the last process is late by
  ``--collective-timeout`` + 3 s at step ``k`` but alive: does the others' step fail?
* ``rejoin``: ``kill1``, then a replacement process starts with the dead one's id and the same
  coordinator address; it and the survivors loop on ``live_devices`` until they agree on a
  grown set, the survivors send ``w`` to it by a ``psum`` over a mesh of all of them, and all
  run one step.

Other switches: ``--lib`` (the survivors ask :func:`jaxcoll.distributed.live_devices`),
``--jaxcoll-init`` (join with ``jaxcoll.init``), ``--clean-exit`` (leave through Python's exit,
JAX's shutdown barrier, instead of ``os._exit``), ``--rejoin-mesh sorted`` (the rejoined mesh
in the first mesh's device order).

Printed: one row per scenario and process; times in seconds after the victim's SIGKILL.
Columns: ``chk ms`` a healthy ``live_devices`` call (median of 5, every process calling);
``next step`` how the first step after the kill ended, and when; ``live calls`` the
``live_devices`` calls until the victim was out (the first raises ``ProcessFailureError``),
and when the last returned; ``new step`` when the first step on the mesh of the live devices
was done (compile included); ``err`` that step and 3 more against NumPy; ``rejoin`` when the
step on the mesh grown by the replacement was done, ``w[0]`` what it gave (``=NumPy``: the
survivors' value after one more step on every device); ``exit`` status (-9 SIGKILL, -6 SIGABRT).

Measured (jax/jaxlib 0.10.2, 2 shared CPU cores; the default command, 38 s; ``chk ms``
1.8-4.1, ``devs`` 4 after the loss)::

    | job    | p  | next step  | live calls | new step | err   | rejoin  | w[0]          | exit    |
    | kill1  | 0  | raise 5.01 | 2 ok 5.02  | 5.23     | 1e-06 | -       | -             | 0 5.48  |
    | kill1  | 1  | -          | 0 - -      | -        | -     | -       | -             | -9 0.07 |
    | detect | 0  | -          | 2 ok 2.50  | 2.74     | 1e-06 | -       | -             | 0 8.14  |
    | kill0  | 1  | -          | 0 - -      | -        | -     | -       | -             | -6 0.48 |
    | rejoin | 0  | raise 5.02 | 2 ok 5.02  | 5.20     | 1e-06 | ok 8.18 | -21.65 =NumPy | 0 8.43  |
    | rejoin | 1r | -          | 1 ok 7.73  | -        | -     | ok 8.18 | -21.65        | 0 8.23  |

``--procs 4 --devs 2`` (51 s): the same, 6 devices left; new step at 5.44 (kill1) and 3.38
(detect), rejoin step at 9.5, the 3 survivors of a dead process 0 aborted at 0.4-0.6 s.
Detection (``detect``) scales with the heartbeat timeout: 2.4-3.7 s at 3 s, 8.7-9.7 s at 10,
1.6 s at 1. With ``--collective-timeout 0`` (jaxcoll-run's week) the survivor's step hangs
(30 s bound) and holds its devices: an elementwise op on them hangs too and the step on the
new mesh never runs. With ``--rejoin-mesh sorted`` the survivor's step raises ``INTERNAL:
Error dispatching computation: Gloo all-reduce failed: ... Connection closed by peer`` (its
cached communicator for that device list) and the replacement's ``Gloo context initialization
failed: ALREADY_EXISTS: key cpu:gloo/0,1,2,3,2048,2049,2050,2051/4 already exists``.
``--scenarios straggle`` (late by 8 s, alive): process 0's step raises at 5.0 s (``Gloo
all-reduce failed ... Connection closed by peer``), the late one's as soon as it arrives;
``live_devices`` then lists all 8 and a step over all 8 in a new device order runs (13.7 s).
``--jaxcoll-init --clean-exit``: the same numbers; the survivors exit 0 within 1 s.
``--donate`` (the step donates ``w``): the failed step has deleted the survivor's ``w``
(``RuntimeError: Array has been deleted with shape=float32[16]``): nothing to go on from.
``--split async`` (a ``pmean`` program, then an update program donating ``w``, dispatched
back to back): the same, ``w`` is gone (donated at dispatch); ``--split wait`` (block on the
``pmean`` before dispatching the update): ``w`` survives and the run goes on (5.2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 0.1
N = 16
USE_LIB = False  # --lib: the survivors ask jaxcoll.distributed.live_devices
DONATE = False  # --donate: the step donates w, as a Trainer's step donates its state


# ----------------------------------------------------------------------------- worker side


class Recorder:
    """Events of one process, rewritten to ``out/p<pid>.json`` after each (a kill loses none)."""

    def __init__(self, out: str, pid: int, tag: str = ""):
        self.path = os.path.join(out, f"p{pid}{tag}.json")
        self.events: dict = {"pid": pid}

    def __call__(self, key: str, value) -> None:
        self.events[key] = value
        with open(self.path + ".tmp", "w") as fh:
            json.dump(self.events, fh, default=str)
        os.replace(self.path + ".tmp", self.path)
        print(f"[{self.events['pid']} {time.time():.3f}] {key}: {value}", flush=True)


def bounded(fn, seconds: float):
    """Run ``fn()`` in a thread: ``("ok", value, s)``, ``("raised", exc, s)`` or
    ``("hung", None, s)`` after ``seconds`` (the thread is left behind)."""
    box: dict = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - recorded, whatever it is
            box["e"] = e

    t0 = time.time()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    dt = time.time() - t0
    if th.is_alive():
        return "hung", None, dt
    if "e" in box:
        return "raised", box["e"], dt
    return "ok", box["v"], dt


def describe(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:400]}"


def make_step(mesh):
    import jax
    from jax.sharding import PartitionSpec as P

    def body(w, g):
        return w - LR * jax.lax.pmean(g[0], "data")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    return jax.jit(f, donate_argnums=(0,) if DONATE else ())


def make_split_step(mesh, wait: bool):
    """The step as two programs: the gradient's ``pmean`` (may fail with a peer, donates
    nothing), then the update (local, donates ``w``); ``wait``: block between them."""
    import jax
    from jax.sharding import PartitionSpec as P

    reduce = jax.jit(
        jax.shard_map(
            lambda g: jax.lax.pmean(g[0], "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
        )
    )
    update = jax.jit(lambda w, r: w - LR * r, donate_argnums=(0,))

    def step(w, g):
        r = reduce(g)
        if wait:
            r.block_until_ready()
        return update(w, r)

    return step


def grads(mesh, i: int):
    """The step-``i`` gradient array: device at mesh position ``r`` holds ``(i + 1) + r``."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def block(idx) -> np.ndarray:
        return np.full((1, N), float(i + 1 + idx[0].start), np.float32)

    return jax.make_array_from_callback(
        (mesh.devices.size, N), NamedSharding(mesh, P("data")), block
    )


def replicated(mesh, value):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, P()), lambda i: value)


def local(arr):
    import numpy as np

    return np.asarray(arr.addressable_shards[0].data)


def oracle(w, i: int, n: int):
    return w - LR * ((i + 1) + (n - 1) / 2)


def initialize(a, rec) -> None:
    import jax

    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if a.jaxcoll_init:  # jaxcoll's join: its watchdog, SIGTERM handler and exit records too
        import jaxcoll

        join = lambda: jaxcoll.init(  # noqa: E731
            f"127.0.0.1:{a.port}",
            a.procs,
            a.pid,
            initialization_timeout=60,
            heartbeat_timeout=a.heartbeat,
            shutdown_timeout=5,
        )
    else:
        join = lambda: jax.distributed.initialize(  # noqa: E731
            f"127.0.0.1:{a.port}",
            a.procs,
            a.pid,
            initialization_timeout=60,
            heartbeat_timeout_seconds=a.heartbeat,
            shutdown_timeout_seconds=5,
        )
    status, value, dt = bounded(join, 90)
    rec("init", {"status": status, "s": round(dt, 3), "error": value and describe(value)})
    if status != "ok":
        os._exit(3)
    status, value, dt = bounded(lambda: [d.id for d in jax.devices()], 60)
    rec("devices", {"status": status, "s": round(dt, 3), "ids": value if status == "ok" else None})
    if status != "ok":
        os._exit(3)


def live_call(devices, seconds: float):
    """One ``with live_devices(devices)`` (enter and exit), bounded: (status, ids or error, s)."""
    from jax.experimental import multihost_utils as mu

    def call():
        if USE_LIB:  # jaxcoll's bounded wrapper: agrees again after a change
            from jaxcoll.distributed import live_devices

            return [d.id for d in live_devices(devices, timeout=seconds - 1)]
        with mu.live_devices(devices) as live:
            return [d.id for d in live]

    status, value, dt = bounded(call, seconds)
    if status == "raised":
        value = describe(value)
    return status, value, dt


def run_until_failure(a, rec, mesh, step, w):
    """Steps until one fails (or the victim dies); returns (w, failed step index)."""
    victim = 0 if a.scenario == "kill0" else a.procs - 1
    healthy = []
    for i in range(a.kill_step + 40):
        if a.pid == victim and i == a.kill_step:
            if a.scenario == "detect":
                time.sleep(1.0)
            with open(os.path.join(a.out, "killed"), "w") as fh:
                fh.write(repr(time.time()))
            if a.scenario == "straggle":  # late, not dead: longer than the collective timeout
                time.sleep(a.collective_timeout + 3)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        if a.scenario == "detect" and i == a.kill_step:
            return w, i
        if i < 5:  # the cost of a healthy check (every process calls it)
            healthy.append(live_call(list(mesh.devices.flat), 60)[2])
            if i == 4:
                rec("healthy_live_s", sorted(healthy)[2])
        bound = a.collective_timeout + 30 if a.collective_timeout else 30
        status, value, dt = bounded(
            lambda w=w, i=i: step(w, grads(mesh, i)).block_until_ready(), bound
        )
        if status != "ok":
            err = describe(value) if status == "raised" else None
            rec("step_fail", {"step": i, "status": status, "at": time.time(), "s": dt, "err": err})
            return w, i
        w = value
    rec("step_fail", None)
    return w, None


def detect(a, rec, devices):
    """``live_devices`` until the victim's devices are gone (at most 8 calls)."""
    import jax

    calls = []
    for _ in range(8):
        status, value, dt = live_call(devices, 60)
        calls.append({"status": status, "value": value, "s": round(dt, 3), "end": time.time()})
        if status == "ok" and all(
            d.process_index != (a.procs - 1 if a.scenario != "kill0" else 0)
            for d in jax.devices()
            if d.id in value
        ):
            break
        if status == "hung" or (status == "ok" and a.scenario == "straggle"):
            break
    rec("live_calls", calls)
    return calls[-1]


def old_arrays(rec, w) -> None:
    import numpy as np

    checks = {
        "local_shard": lambda: local(w)[0],
        "np_asarray_global": lambda: np.asarray(w)[0],
        "elementwise_old_mesh": lambda: local(w + 1)[0],
    }
    out = {}
    for name, fn in checks.items():
        status, value, dt = bounded(fn, 15)
        out[name] = f"{status} {dt:.2f}s" + (f" {describe(value)}" if status == "raised" else "")
    rec("old_arrays", out)


def recover(a, rec, w, i, live_ids):
    """A mesh of the live devices, ``w`` from the local shard, 4 steps checked against NumPy."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devs = sorted((d for d in jax.devices() if d.id in live_ids), key=lambda d: d.id)
    if len(devs) == len(jax.devices()):  # nobody died (straggle): a new order, a new clique
        devs = devs[len(jax.local_devices()) :] + devs[: len(jax.local_devices())]
    mesh = Mesh(np.array(devs), ("data",))
    step = make_step(mesh)
    expect = local(w)
    w2 = replicated(mesh, expect)
    err = 0.0
    for j in range(i, i + 4):
        status, value, dt = bounded(
            lambda w2=w2, j=j: step(w2, grads(mesh, j)).block_until_ready(), 120
        )
        if status != "ok":
            rec("recovered_step_fail", {"step": j, "status": status, "s": dt})
            return None, None
        w2, expect = value, oracle(expect, j, len(devs))
        err = max(err, float(np.max(np.abs(local(w2) - expect))))
        if j == i:
            rec("first_step_done", {"at": time.time(), "s_incl_compile": round(dt, 3)})
    rec("recovered", {"devices": len(devs), "max_err_vs_numpy": err, "w0": float(local(w2)[0])})
    return mesh, w2


def old_mesh_collective(rec, mesh, w, i) -> None:
    step = make_step(mesh)
    status, value, dt = bounded(lambda: step(w, grads(mesh, i)).block_until_ready(), 60)
    err = describe(value) if status == "raised" else None
    rec("old_mesh_collective", {"status": status, "s": round(dt, 2), "err": err})


def grow(a, rec, w, have: int):
    """Survivor (or the replacement, ``w`` None): ``live_devices`` until it lists more than
    ``have`` devices, then ``psum`` ``w`` from the survivors into all and run one step."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    calls = []
    t_end = time.time() + a.rejoin_wait
    while time.time() < t_end:
        status, value, dt = live_call(jax.devices(), 30)
        calls.append({"status": status, "value": value, "s": round(dt, 3), "end": time.time()})
        if status == "hung" or (status == "ok" and len(value) > have):
            break
        time.sleep(0.5)
    rec("grow_calls", calls[-6:])
    if calls[-1]["status"] != "ok" or len(calls[-1]["value"]) <= have:
        return
    devs = sorted((d for d in jax.devices() if d.id in calls[-1]["value"]), key=lambda d: d.id)
    if a.rejoin_mesh == "rotated":  # a device order no earlier mesh had: a new gloo clique
        devs = devs[have:] + devs[:have]
    mesh = Mesh(np.array(devs), ("data",))
    src = w is not None
    nsrc = sum(d.process_index != a.victim for d in devs)
    mine = (local(w) if src else np.zeros(N, np.float32)) / nsrc

    def share():
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        f = jax.shard_map(
            lambda x: jax.lax.psum(x[0], "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
        )
        part = jax.make_array_from_callback(
            (len(devs), N),
            jax.sharding.NamedSharding(mesh, P("data")),
            lambda idx: mine[None] if src else jnp.zeros((1, N), np.float32),
        )
        full = jax.jit(f)(part)
        return make_step(mesh)(full, grads(mesh, 100)).block_until_ready()

    status, value, dt = bounded(share, 90)
    out = {"status": status, "s": round(dt, 2), "at": time.time()}
    out["w0"] = float(local(value)[0]) if status == "ok" else None
    if src:  # what every process must hold: the survivors' w after one step on all devices
        out["expect_w0"] = float(oracle(local(w), 100, len(devs))[0])
    out["err"] = describe(value) if status == "raised" else None
    rec("grown_step", out)


def finish(a, rec) -> None:
    """End a process that got through: at once, or (``--clean-exit``) through Python's exit,
    which runs ``jax.distributed.shutdown`` (its shutdown barrier) with a peer dead."""
    if a.clean_exit:
        rec("exit_start", time.time())
        sys.exit(0)
    os._exit(0)


def worker(a) -> None:
    global USE_LIB, DONATE
    USE_LIB, DONATE = a.lib, a.donate
    rec = Recorder(a.out, a.pid, "r" if a.replacement else "")
    initialize(a, rec)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    if a.replacement:
        grow(a, rec, None, len(jax.devices()) - len(jax.local_devices()))
        finish(a, rec)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    w = replicated(mesh, np.zeros(N, np.float32))
    first = make_step(mesh) if a.split == "no" else make_split_step(mesh, a.split == "wait")
    w, i = run_until_failure(a, rec, mesh, first, w)
    if i is None:
        os._exit(0)
    last = detect(a, rec, list(jax.devices()))
    if last["status"] != "ok":
        os._exit(0)
    old_arrays(rec, w)
    mesh2, w2 = recover(a, rec, w, i, last["value"])
    if mesh2 is None:
        os._exit(0)
    if a.scenario == "rejoin":
        with open(os.path.join(a.out, f"recovered{a.pid}"), "w") as fh:
            fh.write("1")
        grow(a, rec, w2, mesh2.devices.size)
        # Process 0 hosts the coordination service: stay until the replacement is done.
        path, until = os.path.join(a.out, f"p{a.victim}r.json"), time.time() + 20
        while time.time() < until:
            with open(path) if os.path.exists(path) else open(os.devnull) as fh:
                if "grown_step" in fh.read():
                    break
            time.sleep(0.2)
    else:
        old_mesh_collective(rec, mesh, w, i)
    finish(a, rec)


# ----------------------------------------------------------------------------- parent side


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(a, scenario: str, pid: int, port: int, out: str, replacement: bool = False):
    sys.path.insert(0, ROOT)
    from jaxcoll._xla_flags import with_xla_cpu_flags

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXCOLL_", "JAX_"))}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    mine = f"--xla_cpu_collective_timeout_seconds={a.collective_timeout}"
    env["XLA_FLAGS"] = with_xla_cpu_flags(mine if a.collective_timeout else "", a.devs)
    args = [sys.executable, os.path.abspath(__file__), "--worker", "--scenario", scenario]
    args += ["--pid", str(pid), "--port", str(port), "--out", out]
    args += ["--procs", str(a.procs), "--devs", str(a.devs), "--heartbeat", str(a.heartbeat)]
    args += ["--kill-step", str(a.kill_step), "--rejoin-wait", str(a.rejoin_wait)]
    args += ["--rejoin-mesh", a.rejoin_mesh] + (["--lib"] if a.lib else [])
    args += ["--clean-exit"] if a.clean_exit else []
    args += ["--jaxcoll-init"] if a.jaxcoll_init else []
    args += ["--donate"] if a.donate else []
    args += ["--split", a.split]
    args += ["--victim", str(a.procs - 1)] + (["--replacement"] if replacement else [])
    tag = "r" if replacement else ""
    log = open(os.path.join(out, f"p{pid}{tag}.log"), "w")
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def run_job(a, scenario: str) -> dict:
    name = f"{scenario}_{a.procs}x{a.devs}_hb{a.heartbeat}_ct{a.collective_timeout}"
    name += (
        ("_lib" if a.lib else "")
        + ("_jaxcollinit" if a.jaxcoll_init else "")
        + ("_donate" if a.donate else "")
        + ("" if a.split == "no" else f"_split{a.split}")
        + ("_sorted" if scenario == "rejoin" and a.rejoin_mesh == "sorted" else "")
    )
    out = os.path.join(a.out, name)
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):
        os.remove(os.path.join(out, f))
    port = free_port()
    procs = {str(p): spawn(a, scenario, p, port, out) for p in range(a.procs)}
    deadline = time.time() + a.job_timeout
    exits: dict = {}
    started: dict = {}
    while time.time() < deadline:
        for name, p in procs.items():
            if name not in exits and p.poll() is not None:
                exits[name] = (p.returncode, time.time())
        if all(name in exits for name in procs):
            break
        if scenario == "rejoin" and "r" not in procs:
            ready = all(
                os.path.exists(os.path.join(out, f"recovered{k}")) for k in range(a.procs - 1)
            )
            if ready:
                procs["r"] = spawn(a, scenario, a.procs - 1, port, out, replacement=True)
                started["r"] = time.time()
        time.sleep(0.2)
    for name, p in procs.items():  # nothing outlives its job
        if p.poll() is None:
            exits[name] = ("killed by us at the job timeout", time.time())
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    return {"out": out, "exits": exits, "started": started}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default="kill1,detect,kill0,rejoin")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--devs", type=int, default=4)
    ap.add_argument("--heartbeat", type=int, default=3, help="heartbeat_timeout_seconds")
    ap.add_argument(
        "--collective-timeout",
        type=int,
        default=5,
        help="--xla_cpu_collective_timeout_seconds (gloo's wait per operation); "
        "0: jaxcoll-run's (a week)",
    )
    ap.add_argument("--kill-step", type=int, default=8)
    ap.add_argument("--rejoin-wait", type=float, default=40.0)
    ap.add_argument(
        "--rejoin-mesh",
        choices=("sorted", "rotated"),
        default="rotated",
        help="device order of the mesh after the rejoin (sorted = the first mesh's)",
    )
    ap.add_argument(
        "--lib",
        action="store_true",
        help="ask jaxcoll.distributed.live_devices instead of JAX's directly",
    )
    ap.add_argument(
        "--clean-exit",
        action="store_true",
        help="survivors leave through sys.exit (JAX's shutdown) instead of os._exit",
    )
    ap.add_argument(
        "--jaxcoll-init",
        action="store_true",
        help="join with jaxcoll.init instead of jax.distributed.initialize",
    )
    ap.add_argument("--donate", action="store_true", help="the step donates w")
    ap.add_argument(
        "--split",
        choices=("no", "async", "wait"),
        default="no",
        help="steps before the kill as a pmean program, then an update program "
        "that donates w (wait: block on the pmean first)",
    )
    ap.add_argument("--job-timeout", type=float, default=150.0)
    ap.add_argument("--out", default="/tmp/ft/runs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replacement", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--victim", type=int, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _since(kill, t):
    return "-" if kill is None or t is None else f"{t - kill:.2f}"


def _w0(w0, expect) -> str:
    if w0 is None:
        return "-"
    if expect is None:
        return f"{w0:.3f}"
    return f"{w0:.3f} " + ("(=NumPy)" if abs(w0 - expect) < 1e-4 else f"(NumPy {expect:.3f})")


def summarize(job: dict, a) -> list[list[str]]:
    """One row per process of a finished job."""
    out = job["out"]
    kill_path = os.path.join(out, "killed")
    kill = float(open(kill_path).read()) if os.path.exists(kill_path) else None
    rows = []
    names = sorted(f for f in os.listdir(out) if f.endswith(".json"))
    for name in names:
        with open(os.path.join(out, name)) as fh:
            ev = json.load(fh)
        who = name[1:-5]
        fail = ev.get("step_fail") or {}
        calls = ev.get("live_calls") or ev.get("grow_calls") or []
        last = calls[-1] if calls else {}
        first = ev.get("first_step_done") or {}
        rec = ev.get("recovered") or {}
        grown = ev.get("grown_step") or {}
        code = job["exits"].get(who, ("?", None))
        if who.endswith("r"):
            code = job["exits"].get("r", ("?", None))
        healthy = ev.get("healthy_live_s")
        w0 = grown.get("w0")
        rows.append(
            [
                os.path.basename(out).split("_")[0],
                who,
                "-" if healthy is None else f"{healthy * 1e3:.1f}",
                f"{fail.get('status', '-')} {_since(kill, fail.get('at'))}" if fail else "-",
                f"{len(calls)} {last.get('status', '-')} {_since(kill, last.get('end'))}",
                _since(kill, first.get("at")),
                str(rec.get("devices", "-")),
                f"{rec['max_err_vs_numpy']:.0e}" if "max_err_vs_numpy" in rec else "-",
                f"{grown.get('status')} {_since(kill, grown.get('at'))}" if grown else "-",
                _w0(w0, grown.get("expect_w0")),
                f"{code[0]}" + (f" {_since(kill, code[1])}" if code[1] else ""),
            ]
        )
    return rows


HEAD = [
    "job",
    "proc",
    "chk ms",
    "next step",
    "live calls",
    "new step",
    "devs",
    "err",
    "rejoin",
    "w[0]",
    "exit",
]


def main(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for scenario in a.scenarios.split(","):
        t0 = time.time()
        job = run_job(a, scenario)
        print(
            f"# {scenario}: {time.time() - t0:.1f} s, {a.procs} x {a.devs} devices, "
            f"heartbeat {a.heartbeat} s, collective timeout {a.collective_timeout} s; "
            f"logs and events in {job['out']}",
            flush=True,
        )
        rows += summarize(job, a)
        kill_path = os.path.join(job["out"], "killed")
        if "r" in job["started"] and os.path.exists(kill_path):
            since = job["started"]["r"] - float(open(kill_path).read())
            print(f"#   replacement process started {since:.2f} s after the kill", flush=True)
    widths = [max(len(r[k]) for r in [HEAD, *rows]) for k in range(len(HEAD))]
    for r in [HEAD, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print(
        "times: seconds after the victim's SIGKILL; event details (exception messages, "
        "old-array checks, every live_devices call): the p*.json files named above."
    )


if __name__ == "__main__":
    args = parse()
    if args.worker:
        worker(args)
    else:
        main(args)
