"""Flat vs hierarchical MoE dispatch: the bytes each device moves between processes in one
compiled training step, read from its optimized HLO, and the outputs and gradients of both.

    .venv/bin/python benchmarks/moe_hierarchical.py     # ~40 s of CPU, 8 simulated devices

8 simulated CPU devices as 2 processes (nodes) x 4 devices: the mesh ``(node, local) = (2, 4)``,
the devices of mesh row ``i`` standing for process ``i`` (in a real 2 x 4 job,
tests/multihost/workers/moe_hierarchical.py reads the processes from the devices and counts
the same). The layer: :func:`jaxcoll.parallel.moe_mlp`, 16 experts (2 per device), k = 4,
width 64, hidden 128, each device 4 sequences of 32 tokens; rows ``flat`` (the expert axis
``("node", "local")``, one ragged all-to-all over the 8 devices) and ``hierarchical`` (the
same axis with ``hierarchical=True``), dropless and with node-limited routing
(``groups=2, group_limit=1``: each token's experts on one node).

The step compiled is ``jax.grad`` of a loss of the layer's output (forward and backward).
For each collective of the per-device program the bytes it brings a device from devices of
the other process (:func:`cross_process_bytes`): an all-to-all's or all-gather's result has
one equal part per member of the group, from that member; an all-reduce moves twice its bytes
times the share of the group in other processes (reduce-scatter then all-gather); a
collective-permute brings its whole result from its source. Averaged over the 8 devices.
Where XLA has no ragged all-to-all (CPU) each exchange moves its static capacity (padded),
so the table also gives ``ragged rows``: the rows a ragged all-to-all (GPU) would move
between processes for this batch, counted from the routing itself.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import numpy as np

from benchmarks.hlo_stats import computations

_KIND = re.compile(
    r"=\s*(.*?)\s(all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)"
    r"(-start)?\("
)
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_WIDTH = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2}
_WIDTH |= {"s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_GROUPS = re.compile(r"replica_groups=(\{\{[\d,{} ]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_PAIRS = re.compile(r"source_target_pairs=\{([\d,{} ]*)\}")
_CALLEE = re.compile(r"\b(?:body|condition|to_apply|calls)=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _nbytes(shapes: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shapes):
        total += math.prod(int(d) for d in dims.split(",") if d) * _WIDTH.get(dtype, 4)
    return total


def _groups(text: str) -> list[list[int]]:
    """The replica groups of an HLO attribute: ``{{0,4},{1,5}}`` or the iota form
    ``[G,S]<=[dims]T(perm)``."""
    if text.startswith("{{"):
        return [
            [int(v) for v in g.split(",") if v.strip()] for g in re.findall(r"\{([\d, ]*)\}", text)
        ]
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m is None:
        raise ValueError(f"replica_groups={text!r} is neither a list nor an iota form.")
    shape = [int(v) for v in m.group(1).split(",")]
    dims = [int(v) for v in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return [[int(v) for v in row] for row in ids.reshape(shape)]


def _multiplicity(text: str) -> dict[str, int]:
    """How many times each computation runs per step (a while body: its known trip count)."""
    entry, comps = computations(text)
    mult: dict[str, int] = {}

    def visit(name: str, k: int) -> None:
        if name not in comps:
            return
        mult[name] = mult.get(name, 0) + k
        for line in comps[name]:
            trip = _TRIP.search(line)
            body = _BODY.search(line) if " while(" in line else None
            for callee in _CALLEE.findall(line):
                loop = trip is not None and body is not None and callee == body.group(1)
                visit(callee, k * (int(trip.group(1)) if trip is not None and loop else 1))

    if entry is not None:
        visit(entry, 1)
    return mult


def _far(kind: str, size: int, line: str, process: list[int]) -> float:
    """The bytes one execution of the collective ``line`` brings the devices, summed over
    them, from devices of another process."""
    if kind == "collective-permute":
        pairs = _PAIRS.search(line)
        found = re.findall(r"\{(\d+),(\d+)\}", pairs.group(1) if pairs else "")
        return float(sum(size for s, t in found if process[int(s)] != process[int(t)]))
    g = _GROUPS.search(line)
    groups = _groups(g.group(1)) if g else [list(range(len(process)))]
    share = {"all-reduce": 2.0, "reduce-scatter": None}.get(kind, 1.0)
    far = 0.0
    for group in groups:
        for d in group:
            other = sum(process[m] != process[d] for m in group)
            far += size * (len(group) if share is None else share) * other / len(group)
    return far


def cross_process_bytes(text: str, process: list[int]) -> dict[str, float]:
    """Bytes per device, by collective kind, that the compiled program ``text``
    (``compiled.as_text()``) brings each device from devices of another process, averaged
    over the devices; ``process[i]``: the process of the program's device (partition) ``i``.
    """
    _, comps = computations(text)
    out: dict[str, float] = {}
    for comp, k in _multiplicity(text).items():
        for line in comps[comp]:
            m = _KIND.search(line)
            if m:
                far = _far(m.group(2), _nbytes(m.group(1)), line, process)
                out[m.group(2)] = out.get(m.group(2), 0.0) + k * far / len(process)
    return out


def _setup(groups: int | None, group_limit: int | None):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcoll import parallel

    e, d, h, k, b, s = 16, 64, 128, 4, 32, 32
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "local"))
    ax = ("node", "local")
    keys = jax.random.split(jax.random.key(0), 4)
    args = (
        jax.random.normal(keys[0], (b, s, d)),
        jax.random.normal(keys[1], (d, e)),
        jax.random.normal(keys[2], (e, d, h)) / math.sqrt(d),
        jax.random.normal(keys[3], (e, h, d)) / math.sqrt(h),
    )
    specs = (P(ax), P(), P(ax), P(ax))
    placed = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(args, specs)]

    def step(hierarchical: bool):
        def grads(x, router, w_in, w_out):
            def loss(x, router, w_in, w_out):
                y, _ = parallel.moe_mlp(
                    x, router, w_in, w_out, k=k, axis_name=ax, groups=groups,
                    group_limit=group_limit, hierarchical=hierarchical,
                )  # fmt: skip
                return jnp.sum(y**2) / y.size, y

            router = jax.lax.pcast(router, ax, to="varying")
            (_, y), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
                x, router, w_in, w_out
            )
            return y, g[0], jax.lax.psum(g[1], ax), g[2], g[3]

        out_specs = (P(ax), P(ax), P(), P(ax), P(ax))
        return jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=specs, out_specs=out_specs))

    return mesh, args, placed, step, (e, k)


def ragged_rows(args, e: int, k: int, groups, group_limit) -> tuple[int, int]:
    """The rows a ragged all-to-all would move between processes per device, forward
    dispatch only, for the flat and the hierarchical exchange (NumPy, from the routing)."""
    import jax
    import jax.numpy as jnp

    from jaxcoll.parallel.moe.router import route

    x, router = np.asarray(args[0]), np.asarray(args[1])
    logits = jnp.asarray(x @ router)
    kw = {} if groups is None else {"groups": groups, "group_limit": group_limit}
    expert = np.asarray(jax.jit(lambda z: route(z, k, **kw).expert)(logits))
    b = x.shape[0]
    home = np.repeat(np.arange(8) // 4, b // 8)  # each sequence's process
    node = expert // (e // 2)  # (B, S, k): the expert's process
    away = node != home[:, None, None]
    flat = int(away.sum())
    hier = sum(int(np.any(node == p, axis=-1)[home != p].sum()) for p in range(2))
    return flat // 8, hier // 8


def main() -> int:
    import jax

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    rows = []
    for label, groups, limit in (("dropless", None, None), ("node-limited M=1", 2, 1)):
        mesh, args, placed, step, (e, k) = _setup(groups, limit)
        process = [i // 4 for i in range(8)]
        outs, counts = {}, {}
        for name, hier in (("flat", False), ("hierarchical", True)):
            fn = step(hier)
            text = fn.lower(*placed).compile().as_text()
            counts[name] = cross_process_bytes(text, process)
            outs[name] = [np.asarray(o) for o in fn(*placed)]
        err = max(
            float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-30))
            for a, b in zip(outs["flat"], outs["hierarchical"])
        )
        flat_rows, hier_rows = ragged_rows(args, e, k, groups, limit)
        for name in ("flat", "hierarchical"):
            c = counts[name]
            rows.append(
                (label, name, c.get("all-to-all", 0.0), sum(c.values()), err,
                 flat_rows if name == "flat" else hier_rows)
            )  # fmt: skip
        del mesh
    print(f"jax {jax.__version__}, 2 processes (nodes) x 4 devices, simulated on 8 CPU devices")
    print(
        f"{'routing':<18}{'dispatch':<14}{'A2A KiB':>10}{'all KiB':>10}"
        f"{'ragged rows':>13}{'max rel diff':>14}"
    )
    for label, name, a2a, total, err, rr in rows:
        print(f"{label:<18}{name:<14}{a2a / 1024:>10.1f}{total / 1024:>10.1f}{rr:>13}{err:>14.1e}")
    print(
        "KiB: per device and training step (forward + backward), brought from the other "
        "process; ragged rows: forward dispatch rows a ragged all-to-all would send to the "
        "other process per device; max rel diff: outputs and gradients, hierarchical vs flat."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
