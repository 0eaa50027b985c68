"""The devices a benchmark runs on: JAX's setup, the mesh, and values gathered per process."""

from __future__ import annotations

import argparse
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh


def init_jax(a: argparse.Namespace) -> None:
    """Simulate ``a.devices`` CPU devices and join the job when ``a.num_processes > 1``."""
    if a.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.config.update("jax_num_cpu_devices", a.devices)
    except RuntimeError:
        pass  # the backend is already up (e.g. inside tests): use the devices it has
    if a.num_processes > 1 and not jax.distributed.is_initialized():
        if not a.coordinator:
            raise SystemExit("jaxcoll-bench: --num-processes > 1 needs --coordinator HOST:PORT")
        jax.distributed.initialize(
            a.coordinator, num_processes=a.num_processes, process_id=a.process_id
        )


def make_mesh(a: argparse.Namespace) -> tuple[Mesh, Any]:
    """The mesh and the axis name to run over.

    ``--mesh OUTERxINNER`` or, with several processes, processes x local devices: a 2-D mesh
    over ``("outer", "inner")``; else every device on one axis ``"x"``.
    """
    devs = np.array(jax.devices())
    if a.mesh:
        outer, inner = (int(v) for v in a.mesh.lower().split("x"))
    elif jax.process_count() > 1:
        outer, inner = jax.process_count(), jax.local_device_count()
    else:
        return Mesh(devs, ("x",)), "x"
    if outer * inner > devs.size:
        raise SystemExit(
            f"jaxcoll-bench: --mesh {a.mesh} needs {outer * inner} devices, {devs.size} available"
        )
    return Mesh(devs[: outer * inner].reshape(outer, inner), ("outer", "inner")), ("outer", "inner")


def per_process(value: np.generic) -> np.ndarray:
    """``value`` from every process, as an array (of one element in a single process)."""
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(value))
    return np.asarray([value])
