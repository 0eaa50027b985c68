"""What a :class:`~jaxcoll.dp.Survivor` asks of its job and layout: recoverability, a finite
XLA:CPU collective timeout, replicas made of whole processes, the layout's axes named.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.sharding import Mesh

from ..._core.roles import Role
from ..._watch import pause
from ..._xla_flags import XLA_CPU_TIMEOUT_S
from ..layout import Layout

_FLAG = "--xla_cpu_collective_timeout_seconds"
_AXIS_ROLES = (Role.PIPELINE, Role.REPLICATE, Role.SHARD, Role.CONTEXT, Role.TENSOR)


def _named(layout: Layout) -> Layout:
    """``layout`` with each role naming the axis its built mesh gives it (``"replicate"``,
    ``"shard"``, ...), for meshes the Survivor builds itself."""
    names = {r.value: layout._names(r) for r in _AXIS_ROLES}
    given = {role: (n[0] if n else None) for role, n in names.items()}
    if layout.expert is not None:
        given[Role.EXPERT.value] = layout.expert_axis
    return dataclasses.replace(layout, **given)


def _whole_processes(api: str, mesh: Mesh) -> None:
    """Raise unless every process's devices lie in one data replica."""
    blocks = np.moveaxis(mesh.devices, mesh.axis_names.index(Role.REPLICATE.value), 0)
    where: dict[int, set[int]] = {}
    for r in range(blocks.shape[0]):
        for d in blocks[r].flat:
            where.setdefault(d.process_index, set()).add(r)
    split = {p: sorted(rs) for p, rs in where.items() if len(rs) > 1}
    if split:
        p, rs = next(iter(split.items()))
        raise ValueError(
            f"{api}: process {p} holds devices of replicas {rs}; each data replica must be "
            f"whole processes (a lost process takes its replicas with it). Give replicate= "
            f"a divisor of the process count ({jax.process_count()}) and the other roles "
            f"the devices of one replica."
        )


def _check_job(api: str) -> None:
    if jax.process_count() == 1:
        return
    if not getattr(jax.config, "jax_enable_recoverability", False):
        raise RuntimeError(
            f"{api}: the job was started without recoverability, so a lost process ends every "
            f"process; set JAXCOLL_RECOVERABLE=1 for jaxcoll.init (or "
            f'jax.config.update("jax_enable_recoverability", True) before joining) in every '
            f"process."
        )
    if jax.default_backend() != "cpu":
        return
    values = [f.split("=", 1)[1] for f in os.environ.get("XLA_FLAGS", "").split() if "=" in f]
    names = [f.split("=", 1)[0] for f in os.environ.get("XLA_FLAGS", "").split() if "=" in f]
    given = [v for n, v in zip(names, values) if n == _FLAG]
    seconds = float(given[-1]) if given and given[-1].replace(".", "", 1).isdigit() else None
    if seconds is None or seconds <= 0 or seconds >= XLA_CPU_TIMEOUT_S:
        raise ValueError(
            f"{api}: XLA_FLAGS sets {_FLAG}={given[-1] if given else 'nothing'}; a survivor's "
            f"step then waits for a dead process for ever. Start every process with a finite "
            f"one, e.g. XLA_FLAGS='{_FLAG}=5 ...' (read once per process, so the launcher "
            f"sets it)."
        )


def _unwatched() -> None:
    """Turn this process's collective watchdog and flight recorder off: its failed-device
    check ends a process in which part of a step's devices failed while the others wait (a
    survivor's, for a moment, at a loss)."""

    pause()
