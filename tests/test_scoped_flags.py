"""jaxcoll's XLA settings reach jaxcoll's programs only, and a failure on one device ends the
program in seconds: each case in a fresh process (``jaxcoll.init()`` before JAX starts), with
XLA's own flags (no ``XLA_FLAGS`` of jaxcoll's) and a timeout on the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

from jaxcoll._xla_flags import compiler_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 8 simulated devices; the rest of XLA's flags as a user's process has them.
PRELUDE = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jaxcoll
jaxcoll.init()
print("XLA_FLAGS=" + os.environ["XLA_FLAGS"], flush=True)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
"""


def _run(body: str, timeout: float = 90, env: dict[str, str] | None = None):
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAXCOLL_", "JAX_", "MASTER_", "SLURM_", "XLA_FLAGS"))
    }
    clean["PYTHONPATH"] = ROOT
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    return proc, time.monotonic() - start


def test_init_leaves_a_plain_gspmd_program_as_xla_compiles_it():
    # A GSPMD step as a user writes it (params split over data x tensor, the activations
    # constrained to the batch over data), after jaxcoll.init(): XLA_FLAGS untouched, the
    # loss equal to the same step on one device (computed in NumPy-free plain JAX there).
    proc, _ = _run(
        """
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
        rng = np.random.default_rng(0)
        w1 = rng.normal(size=(16, 32)).astype(np.float32) * 0.3
        w2 = rng.normal(size=(32, 16)).astype(np.float32) * 0.3
        x = rng.normal(size=(8, 16)).astype(np.float32)
        act = NamedSharding(mesh, P("data", None))

        def loss(p, x):
            h = jax.lax.with_sharding_constraint(jnp.tanh(x @ p["w1"]), act)
            return jnp.mean((h @ p["w2"] - x) ** 2)

        def step(p, x):
            value, g = jax.value_and_grad(loss)(p, x)
            return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value

        shard = {"w1": NamedSharding(mesh, P("data", "tensor")),
                 "w2": NamedSharding(mesh, P("tensor", "data"))}
        p = jax.device_put({"w1": w1, "w2": w2}, shard)
        xs = jax.device_put(x, act)
        run = jax.jit(step, in_shardings=(shard, act), donate_argnums=0)
        one = {"w1": w1, "w2": w2}
        for _ in range(4):
            p, value = run(p, xs)
            one, want = jax.jit(step)(one, x)  # numpy inputs: one device
            assert abs(float(value) - float(want)) < 1e-5, (float(value), float(want))
        print("ran", float(value), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    flags = proc.stdout.splitlines()[0]  # as the process set them: init() added nothing
    assert flags == "XLA_FLAGS=--xla_force_host_platform_device_count=8", flags
    assert "ran" in proc.stdout


def test_a_failing_stage_ends_the_program_in_seconds_naming_it():
    # A two-stage program whose last stage's host callback raises at run time: the other
    # stage waits for it in a collective. jaxcoll's watchdog sees the failed device's outputs
    # and ends the process naming the program, the device, its stage and the error.
    proc, took = _run(
        """
        from jax.experimental import io_callback
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "stage"))

        def check(stage, h):
            if int(stage) == 1:
                raise ValueError("the last stage's loss hook failed")
            return np.asarray(h)

        def body(x):
            stage = jax.lax.axis_index("stage")
            h = jax.lax.ppermute(jnp.tanh(x), "stage", [(0, 1)])
            h = io_callback(check, jax.ShapeDtypeStruct(h.shape, h.dtype), stage, h)
            h = jax.lax.ppermute(h, "stage", [(1, 0)])
            return jax.lax.psum(jnp.sum(h, keepdims=True)[0], "stage")

        program = jax.jit(jax.shard_map(
            body, mesh=mesh, in_specs=P("data", "stage"), out_specs=P("data")
        ))
        step = jaxcoll.watch(program, name="pipeline step")
        print(step(jnp.ones((8, 8))).sum(), flush=True)
        print("returned", flush=True)
        """,
        env={"JAXCOLL_TRACE_BUFFER": "0"},
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "returned" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("jaxcoll: process 0")]
    assert lines, proc.stderr[-3000:]
    line = lines[-1]
    assert "pipeline step(float32[8,8])" in line, line
    assert "failed on device" in line and "stage=1" in line, line
    assert "ValueError: the last stage's loss hook failed" in line, line
    # XLA's own limit would have ended it after 60 s, with a C++ abort and no name.
    assert took < 45, took


def test_compiler_options_set_the_scheduler_of_one_program():
    # jaxcoll's compile options give a program the schedule the process-wide flag gives it
    # (the collectives' order in the compiled module), and leave other programs at XLA's.
    body = """
        import json
        mesh = Mesh(np.array(jax.devices()), ("d",))

        def body(a, b, c):
            x = jax.lax.psum(jnp.tanh(a @ a.T), "d")
            y = jax.lax.all_gather(jnp.sin(b) @ b.T, "d", tiled=True)
            z = jax.lax.psum_scatter(jnp.cos(c) * 3, "d", tiled=True)
            return jax.lax.psum(x.sum() + y.sum() + z.sum(), "d")

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P()))
        a = jnp.ones((64, 64))

        def order(options):
            text = f.lower(a, a, a).compile(compiler_options=options).as_text()
            entry = text.split("ENTRY")[1].splitlines()
            kinds = ("all-reduce(", "all-gather(", "reduce-scatter(")
            return [ln.split("=")[0].strip() for ln in entry if any(k in ln for k in kinds)]

        print("ORDER " + json.dumps([order(None), order(OPTIONS)]), flush=True)
        """.replace("OPTIONS", repr(compiler_options()))
    proc, _ = _run(body)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ORDER "))
    default, scoped = json.loads(line[len("ORDER ") :])
    assert sorted(default) == sorted(scoped) and len(default) == 4, (default, scoped)
    assert default != scoped, default  # the option changed this program's schedule
