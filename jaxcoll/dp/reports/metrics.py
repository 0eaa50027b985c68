"""Step metrics of :meth:`Trainer.fit <jaxcoll.dp.Trainer.fit>`: time, throughput, FLOPs,
MFU, learning rate and device memory, and :func:`measure_peak_flops`.

Each step's metrics are computed on the host when ``fit`` reads the step's outputs (one step
late, as it reads the loss), from the wall clock and from numbers known once per step
program (its FLOPs and memory, from the compiled program's ``cost_analysis()`` and
``memory_analysis()``): nothing here waits for the device. The learning rate rides along
with the loss in the same transfer.

==================  ===========================================================================
``step_time_s``     wall time between the completions of consecutive steps, as the loop
                    sees them (one per turn: read, or found ready at the start of the next
                    turn; a step read right after the one before, at an evaluation, a save
                    or the end: the time between their dispatches; the first step: from the
                    start of ``fit``, compilation included; an evaluation with its
                    callbacks, a save or a trace in between is not counted)
``examples_per_s``  the global batch size / ``step_time_s``
``tokens_per_s``    ``examples_per_s * tokens_per_example`` (with
                    :class:`~jaxcoll.dp.Throughput`'s ``tokens_per_example``)
``flops_per_step``  the step program's FLOPs on all devices: XLA's ``cost_analysis()``
                    count, which is per device (per SPMD partition), times the device count,
                    or the step's matmul FLOPs where XLA's count lacks them (GPU; see
                    :func:`step_flops`)
``mfu``             ``flops_per_step / step_time_s / (peak_flops * n_devices)`` (with
                    :class:`~jaxcoll.dp.Throughput`'s ``peak_flops``)
``lr``              ``opt_state``'s ``hyperparams["learning_rate"]`` after the step (the
                    rate the step used; optimizers made with ``optax.inject_hyperparams``)
``memory_bytes``    the largest ``peak_bytes_in_use`` of this process's devices where the
                    backend reports ``memory_stats()`` (GPU, TPU), else the step program's
                    argument + temporary bytes per device (``memory_analysis()``)
==================  ===========================================================================
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..._core.typing import PyTree
from ..._jax import ClosedJaxpr, Jaxpr


# ----------------------------------------------------------------------- compiled programs
def _flops(program: Any) -> float | None:
    """``program.cost_analysis()["flops"]`` (a Lowered or a Compiled), or None."""
    try:
        cost = program.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis
        return None
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else None
    flops = cost.get("flops") if isinstance(cost, dict) else None
    if flops is None or not flops > 0:
        return None
    return float(flops)


def matmul_flops(jaxpr: Any) -> float:
    """The FLOPs of every matrix product and convolution in a (closed) jaxpr, on all devices.

    ``dot_general``: 2 x the output's size x the contracted size; ``conv_general_dilated``:
    2 x the output's size x the kernel's size per output feature. Sub-jaxprs are followed:
    a ``scan`` body counts ``length`` times, a ``shard_map`` body (per-device shapes) once
    per device of its manual axes, a ``cond`` its largest branch, a ``while`` body once
    (its trip count is not known). Elementwise work is not counted.
    """

    def count(j: Any) -> float:
        total = 0.0
        for eqn in j.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                k = math.prod(lhs[d] for d in contract)
                total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
                continue
            if name == "conv_general_dilated":
                rhs = eqn.invars[1].aval.shape
                out_feature = eqn.params["dimension_numbers"].rhs_spec[0]
                per_output = math.prod(rhs) / rhs[out_feature]
                total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * per_output
                continue
            subs = [
                x.jaxpr if isinstance(x, ClosedJaxpr) else x
                for v in eqn.params.values()
                for x in (v if isinstance(v, (tuple, list)) else [v])
                if isinstance(x, (ClosedJaxpr, Jaxpr))
            ]
            if not subs:
                continue
            counts = [count(sub) for sub in subs]
            if name == "cond":
                total += max(counts)
            elif name == "scan":
                total += eqn.params["length"] * sum(counts)
            elif name == "shard_map":
                mesh = eqn.params["mesh"]
                manual = eqn.params.get("newly_manual_axes", eqn.params.get("axis_names"))
                axes = mesh.axis_names if not manual else manual
                total += math.prod(mesh.shape[a] for a in axes) * sum(counts)
            else:
                total += sum(counts)
        return total

    return count(getattr(jaxpr, "jaxpr", jaxpr))


def step_flops(compiled: Any, jaxpr: Any, n_devices: int) -> float | None:
    """The FLOPs of one run of a step program on all ``n_devices`` devices it runs on.

    XLA's ``compiled.cost_analysis()["flops"]`` counts one device's program (one SPMD
    partition: on 8 devices, a data-parallel step reports an eighth of the matmul FLOPs), so
    it is multiplied by ``n_devices``. XLA:GPU's count leaves out the matmuls it hands to
    cuBLAS as custom calls (jax-ml/jax#22249; with jax 0.11.2 on an H200, 0.2% of a deep
    MLP's), so the larger of it and the program's :func:`matmul_flops` is taken: XLA's
    count (matmuls and elementwise work) where it holds the matmuls, the matmuls alone
    where it does not. None where neither is known.
    """
    xla = _flops(compiled)
    counts = [] if xla is None else [xla * n_devices]
    if jaxpr is not None:
        try:
            counts.append(matmul_flops(jaxpr))
        except Exception:  # noqa: BLE001 - a primitive whose params are not as expected
            pass
    counts = [c for c in counts if c > 0]
    return max(counts) if counts else None


def compiled_memory_bytes(compiled: Any) -> int | None:
    """Argument + temporary bytes of ``compiled`` on one device (``memory_analysis()``)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without memory analysis
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes)


def device_peak_bytes(devices: list[Any]) -> int | None:
    """The largest ``memory_stats()["peak_bytes_in_use"]`` over ``devices``; None where the
    backend keeps no such statistics (XLA:CPU). A host call to the allocator: no device sync."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - not supported by this backend
            return None
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


# --------------------------------------------------------------------------- peak FLOP/s
def measure_peak_flops(
    dtype: Any = None, *, size: int | None = None, device: Any = None, repeats: int = 5
) -> float:
    """The FLOP/s of a jitted square matmul on one device: a practical peak for MFU.

    Runs ``chain`` products of two ``size x size`` matrices back to back in one jitted
    program (one dispatch), compiled and run once first, then timed ``repeats`` times; the
    median rate is returned (``2 * size**3 * chain`` FLOPs over the median time).

    Args:
        dtype: the matrices' dtype; None: bfloat16 on an accelerator (the dtype MFU is
            usually quoted in), float32 on the CPU (where bfloat16 is emulated).
        size: the matrix side; None: 8192 on an accelerator, 1024 on the CPU.
        device: where to run it; None: this process's first device.
        repeats: timed runs (the median is taken).

    Returns:
        FLOP/s of one device. On simulated CPU devices (XLA's
        ``--xla_force_host_platform_device_count``) the devices share the host's cores, so
        one device alone runs faster than each does when all run: MFU against this peak is
        then a lower bound.

    Example::

        >>> peak = dp.measure_peak_flops()  # e.g. about 7.5e14 for bfloat16 on an H100
        >>> trainer.fit(state, data, steps=100, callbacks=[dp.Throughput(peak_flops=peak)])
    """
    api = "dp.measure_peak_flops"
    device = jax.local_devices()[0] if device is None else device
    accelerator = device.platform != "cpu"
    if dtype is None:
        dtype = jnp.bfloat16 if accelerator else jnp.float32
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{api}: dtype={dtype!r} is not a dtype; pass e.g. jnp.bfloat16 or jnp.float32."
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{api}: dtype={dtype} must be a floating dtype (bfloat16, float32).")
    if size is None:
        size = 8192 if accelerator else 1024
    for name, value in (("size", size), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
            raise ValueError(f"{api}: {name}={value!r} must be a positive int.")
    chain = 8 if accelerator else 2
    rng = np.random.default_rng(0)
    scale = 1.0 / math.sqrt(size)  # keeps the products' entries near 1: no overflow
    a, b = (
        jax.device_put(
            jnp.asarray(rng.standard_normal((size, size), np.float32) * scale, dtype), device
        )
        for _ in range(2)
    )

    @jax.jit
    def products(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, chain, lambda _, c: c @ b, a)

    products(a, b).block_until_ready()  # compile and warm up
    times = []
    for _ in range(int(repeats)):
        t = time.perf_counter()
        products(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2.0 * size**3 * chain / statistics.median(times)


def check_peak_flops(api: str, peak: Any) -> float | str | None:
    """:class:`~jaxcoll.dp.Throughput`'s ``peak_flops=``: None, "measure" or a positive FLOP/s."""
    if peak is None or peak == "measure":
        return peak
    if isinstance(peak, bool) or not isinstance(peak, numbers.Real) or not float(peak) > 0:
        raise ValueError(
            f"{api}: peak_flops={peak!r} must be the peak FLOP/s of one device (a positive "
            f"number, e.g. 989e12 for an H100's dense bfloat16), 'measure' "
            f"(dp.measure_peak_flops() on one device), or None (no mfu)."
        )
    return float(peak)


# ------------------------------------------------------------------------- learning rate
Path = tuple[tuple[str, Any], ...]


def learning_rate_path(opt_state: PyTree) -> Path | None:
    """Where ``opt_state`` keeps ``hyperparams["learning_rate"]`` (the state of
    ``optax.inject_hyperparams``, at any depth of tuples, lists, dicts and named tuples), as
    a path for :func:`at_path`; None if it does not."""

    def find(node: Any, path: Path) -> Path | None:
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, dict) and "learning_rate" in hyper:
            return (*path, ("attr", "hyperparams"), ("item", "learning_rate"))
        if isinstance(node, dict):
            children = [(("item", k), v) for k, v in node.items()]
        elif hasattr(node, "_fields"):  # a named tuple: optax's states
            children = [(("attr", f), getattr(node, f)) for f in node._fields]
        elif isinstance(node, (tuple, list)):
            children = [(("item", i), v) for i, v in enumerate(node)]
        else:
            return None
        for step, child in children:
            found = find(child, (*path, step))
            if found is not None:
                return found
        return None

    return find(opt_state, ())


def at_path(tree: Any, path: Path) -> Any:
    """The node of ``tree`` at ``path`` (a few attribute and item lookups)."""
    for kind, key in path:
        tree = getattr(tree, key) if kind == "attr" else tree[key]
    return tree


# --------------------------------------------------------------------------- the meter
class Costs(NamedTuple):
    """What one step program costs: FLOPs on all devices, argument + temp bytes per device."""

    flops: float | None
    memory_bytes: int | None


# Costs by step program (a jitted function, kept by its Trainer) and argument shapes: a later
# fit of the same Trainer finds them here.
_COSTS: weakref.WeakKeyDictionary[Any, dict[Any, Costs]] = weakref.WeakKeyDictionary()


def program_costs(step: Any, args: tuple[Any, ...], n_devices: int) -> Costs:
    """The costs of the jitted ``step`` on the abstract ``args`` (``Trainer.step_program``'s):
    traced, lowered and compiled once (jax's cached trace and executable when the step
    already ran), then remembered."""
    shapes = tuple(
        (x.shape, str(x.dtype), str(getattr(x, "sharding", None)))
        for x in jax.tree_util.tree_leaves(args)
    )
    key = (jax.tree_util.tree_structure(args), shapes, n_devices)
    try:
        known = _COSTS.setdefault(step, {})
    except TypeError:  # not weakly referenceable: no memory across fits
        known = {}
    if key not in known:
        traced = step.trace(*args)  # jax's caches: traced and compiled when the step ran
        compiled = traced.lower().compile()
        known[key] = Costs(
            step_flops(compiled, traced.jaxpr, n_devices), compiled_memory_bytes(compiled)
        )
    return known[key]


class StepMetrics:
    """The step metrics ``fit`` adds to each step's (see the module docstring).

    ``costs(step, state, batch)`` after a step is dispatched: its program's costs, computed
    once per program (``trainer.step_program(...)`` lowered and compiled: jax's caches hold
    the program the step just compiled, so this compiles nothing again). ``device_values``:
    device arrays to read with the step's metrics (the learning rate, copied before the
    next step donates the state). ``complete(...)``: the host metrics when the step's
    outputs are read.
    """

    def __init__(self, trainer: Any, state: Any) -> None:
        self.trainer = trainer
        mesh = getattr(trainer, "mesh", None)
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()
        self.n = len(devices)
        me = jax.process_index()
        self.local = [d for d in devices if d.process_index == me]
        self.lr_path = learning_rate_path(state.opt_state)
        self.copy = getattr(trainer, "donate", True)  # the next step donates the state
        self.programs: dict[Any, Costs] = {}
        self.device_memory = device_peak_bytes(self.local) is not None
        self.clock = self.sent = time.perf_counter()  # the last completion, the last dispatch
        self.turn = self.done_turn = 0  # the loop's turns (one dispatch each), the last report's
        self.seen: tuple[int, float] | None = None  # (a step in flight, when it was seen done)
        self.last: float | None = None  # the last step's time

    def key(self, host_step: int) -> Any:
        """The step program's identity: the strategy's phase for a phased one."""
        sync = getattr(self.trainer, "sync", None)
        if sync is None or not getattr(sync, "phased", False):
            return None
        return sync.phase(host_step)

    def costs(self, host_step: int, state: Any, batch: PyTree) -> Costs:
        """The costs of the program that ran step ``host_step + 1``; ``state`` is the state
        after it (its shapes and placements are the step's)."""
        key = self.key(host_step)
        found = self.programs.get(key)
        if found is None:
            found = Costs(None, None)
            program_of: Callable[..., Any] | None = getattr(self.trainer, "step_program", None)
            if program_of is not None:
                step, args = program_of(state, batch, step=host_step)
                found = program_costs(step, args, self.n)
            self.programs[key] = found
        return found

    def restart(self) -> None:
        """Start the next step's time now: after an evaluation (and its callbacks), a save or
        a trace, which are not the step's."""
        self.clock = self.sent = time.perf_counter()
        self.seen = None

    def poll(self, step: int, outputs: PyTree) -> None:
        """Call at the start of a turn, before the next dispatch, with the step in flight
        (``state.step`` after it) and its outputs: if they are ready (a look, no wait), the
        step is taken as completed now, not when the loop reads it at the end of the turn."""
        leaves = jax.tree_util.tree_leaves(outputs)
        ready = getattr(leaves[0], "is_ready", None) if leaves else None
        if self.seen is None and ready is not None and ready():
            self.seen = (step, time.perf_counter())

    def dispatched(self) -> tuple[float, float]:
        """Call right after a step is dispatched: (its dispatch time, the previous one's)."""
        now, before = time.perf_counter(), self.sent
        self.sent = now
        self.turn += 1
        return now, before

    def device_values(self, state: Any) -> dict[str, jax.Array]:
        """Device arrays to fetch with the step's metrics (no transfer or wait here)."""
        if self.lr_path is None:
            return {}
        lr = at_path(state.opt_state, self.lr_path)
        return {"lr": jnp.copy(lr) if self.copy else lr}

    def complete(
        self, step: int, examples: int, costs: Costs, sent: tuple[float, float]
    ) -> dict[str, float]:
        """The host metrics of step ``step`` (``state.step`` after it), whose outputs were
        just read; ``sent``: what :meth:`dispatched` returned for it.

        The step's time is the time since the previous step completed: when its outputs
        were read, or, if :meth:`poll` found them ready at the start of the turn, then. One
        step is read per turn of the loop, so this is the loop's period, the device's step
        time when the device is the bottleneck. The first step after a :meth:`restart` is
        read two turns after it (the loop keeps one step in flight): it counts from the
        restart to the start of the turn that found it done (the next batch built), or to
        when it was waited for, so it measures its own turn, not two. A step read in the
        same turn as the one before (the step before an evaluation, a save or the end) gets
        the step before's time (the same program): the device may have finished both before
        the host asked, and the time between their reads, or between their dispatches, can
        be microseconds (a step of 4 examples read at 234327 examples/s).
        """
        now = time.perf_counter()
        seen, self.seen = self.seen, None
        end = seen[1] if seen is not None and seen[0] == step else now
        if self.done_turn == self.turn:  # the second report of this turn
            dt = self.last if self.last is not None else max(sent[0] - sent[1], 1e-9)
        else:
            dt = max(end - self.clock, 1e-9)
        self.clock, self.done_turn, self.last = end, self.turn, dt
        out = {"step_time_s": dt, "examples_per_s": examples / dt}
        if costs.flops is not None:
            out["flops_per_step"] = costs.flops
        memory = device_peak_bytes(self.local) if self.device_memory else costs.memory_bytes
        if memory is not None:
            out["memory_bytes"] = float(memory)
        return out
