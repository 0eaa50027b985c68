"""XLA:CPU's rendezvous timeouts: set by jaxcoll-run and the test setup (never by
jaxcoll.init), and accepted by the installed XLA (an unknown name in ``XLA_FLAGS`` aborts the
process); jaxcoll's compile options accepted by the installed XLA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jaxcoll
from jaxcoll import run
from jaxcoll._xla_flags import XLA_CPU_TIMEOUT_S, compiler_options, with_xla_cpu_flags

NAMES = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds",
    "--xla_cpu_collective_call_terminate_timeout_seconds",
    "--xla_cpu_collective_timeout_seconds",
)


def _values(flags: str) -> dict[str, str]:
    return dict(f.split("=", 1) for f in flags.split())


def test_the_flags_and_how_they_merge():
    flags = jaxcoll.xla_cpu_flags(devices=8)
    assert flags[0] == "--xla_force_host_platform_device_count=8"
    timeouts = [f for f in flags[1:] if f.split("=")[0] in NAMES]
    assert {f.split("=")[0] for f in timeouts} == set(NAMES)
    assert all(f.endswith(f"={XLA_CPU_TIMEOUT_S}") for f in timeouts)
    # one order of the collectives on every device (the scheduler that reorders them is off)
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in flags
    # ... unless the processes' programs take it from their compile options
    scoped = jaxcoll.xla_cpu_flags(devices=8, scheduler=False)
    assert scoped == [f for f in flags if "scheduler" not in f] and len(scoped) == len(flags) - 1
    assert "scheduler" not in with_xla_cpu_flags("", scheduler=False)
    # the user's own setting of a timeout wins; the device count is replaced when given
    merged = _values(
        with_xla_cpu_flags(
            "--xla_force_host_platform_device_count=2 --xla_cpu_collective_timeout_seconds=5", 4
        )
    )
    assert merged["--xla_force_host_platform_device_count"] == "4"
    assert merged["--xla_cpu_collective_timeout_seconds"] == "5"
    assert merged["--xla_cpu_collective_call_terminate_timeout_seconds"] == str(XLA_CPU_TIMEOUT_S)
    assert "device_count" not in with_xla_cpu_flags("")
    # XLA:GPU's combiners off (jaxcoll groups its own collectives), the user's threshold wins
    gpu = _values(with_xla_cpu_flags("--xla_gpu_all_reduce_combine_threshold_bytes=1024"))
    assert gpu["--xla_gpu_all_gather_combine_threshold_bytes"] == "0"
    assert gpu["--xla_gpu_reduce_scatter_combine_threshold_bytes"] == "0"
    assert gpu["--xla_gpu_all_reduce_combine_threshold_bytes"] == "1024"
    assert set(jaxcoll.xla_gpu_flags()) <= set(with_xla_cpu_flags("").split())
    with pytest.raises(ValueError, match="devices=0 must be a positive int"):
        jaxcoll.xla_cpu_flags(devices=0)
    # jaxcoll's programs: the memory-optimized scheduler, for one executable at a time
    assert compiler_options() == {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    compiler_options()["xla_cpu_scheduler_type"] = "x"  # a copy: the next call is unchanged
    assert compiler_options()["xla_cpu_scheduler_type"].endswith("MEMORY_OPTIMIZED")


def test_the_test_setup_and_the_launcher_set_them():
    assert set(NAMES) <= set(_values(os.environ["XLA_FLAGS"]))
    a = run._parse(["--nprocs", "2", "--devices-per-proc", "3", "-m", "x"])
    env = run._child_env(a, "127.0.0.1:1", "127.0.0.1:1", 1, 0)
    values = _values(env["XLA_FLAGS"])
    assert values["--xla_force_host_platform_device_count"] == "3"
    assert set(NAMES) <= set(values)


def test_init_sets_none_and_xla_accepts_them():
    # A fresh process: jaxcoll.init() (one process, nothing to join) leaves XLA_FLAGS as the
    # process set it (the launcher's flags here), XLA parses them (an unknown flag name would
    # abort the process) and compiles a program with jaxcoll's compile options (an unknown
    # option name is an error).
    flags = with_xla_cpu_flags("")
    code = (
        "import os, jaxcoll, jax, jax.numpy as jnp; jaxcoll.init(); "
        "print(os.environ['XLA_FLAGS']); print(len(jax.devices())); "
        "from jaxcoll._xla_flags import compiler_options; "
        "f = jax.jit(lambda x: x * 2, compiler_options=compiler_options()); "
        "print(float(f(jnp.float32(3))))"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAXCOLL_", "JAX_", "MASTER_", "SLURM_", "XLA_FLAGS"))
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = flags
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed, devices, value = proc.stdout.strip().splitlines()
    assert printed == flags and devices == "1" and value == "6.0"
    del env["XLA_FLAGS"]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code.replace("print(os.environ['XLA_FLAGS'])", "print(os.environ.get('XLA_FLAGS'))"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "None"  # nothing added
