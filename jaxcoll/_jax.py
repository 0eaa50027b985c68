"""The one door to JAX internals: every name jaxcoll takes from outside JAX's public API.

jaxcoll defines primitives of its own (the per-platform broadcast, the packed ragged all-to-all,
the replicated cast), reads and sets shard_map's varying-axis types, and asks JAX's distributed
runtime about the job. None of that has a public API, so each internal is reached here and
nowhere else: ``tests/test_layers.py`` fails if another module imports ``jax._src``,
``jax.interpreters`` or ``jax.extend``, and this module imports nothing of jaxcoll, so any
module of any layer may import it. A JAX release that moves one of these breaks this file alone;
``pyproject.toml`` bounds jax and jaxlib to the versions checked.

Checked on jax/jaxlib 0.10.2 (Python 3.11) and 0.11.2 (Python 3.12) by running the tests, and
in jax 0.10.0's source: each name below is at the same place in all three. What is used, and
why:

Defining primitives (where jax has an extension API, it is used: ``jax.extend.core`` and the
``jax.interpreters`` re-exports, the paths libraries such as mpi4jax use):

* :class:`Literal` (``jax.extend.core``): a constant operand of a jaxpr equation, told apart
  from a variable when FSDP evaluates a traced loss equation by equation
  (:mod:`jaxcoll.dp.sync.layerwise`); with it, the equations' parameters, which are not a
  public API and differ between the bounded versions: :func:`scan_counts` (jax 0.10's
  ``num_consts``/``num_carry``, 0.11's ``ft_in`` groups), :data:`CALLS` (0.10's ``pjit`` is
  0.11's ``jit``) and :func:`jaxpr_parts` (inner jaxprs are closed in 0.10 and open in
  0.11's ``scan`` and ``custom_vjp_call``).
* :class:`ClosedJaxpr`, :class:`Jaxpr` (``jax.extend.core``): the sub-jaxprs in an
  equation's parameters, which ``fit``'s matmul FLOP count follows
  (:func:`jaxcoll.dp.reports.metrics.matmul_flops`).
* :class:`Primitive` (``jax.extend.core``): jaxcoll's primitives, so that a collective can get
  one lowering per platform and its own transpose and batching rules.
* :func:`register_lowering`, :func:`lower_fun` (``jax.interpreters.mlir``): a lowering rule
  written as a JAX function.
* :func:`deflinear2`, ``primitive_jvps``, ``primitive_transposes``, :func:`instantiate_zeros`
  (``jax.interpreters.ad``): the primitives are linear; their transposes are collectives too.
* ``primitive_batchers``, ``fancy_primitive_batchers`` (``jax.interpreters.batching``):
  ``jax.vmap``, also with ``axis_name=`` (the fancy rule sees the axis being mapped).
* :func:`lowering_platforms`: ``ctx.module_context.platforms`` of a lowering rule's context,
  every platform the module is lowered for (several under ``jax.export(platforms=...)``), so
  that a GPU-only op is used only in a module no other platform compiles.

shard_map's types (``jax.typeof(x)`` is public; what it carries of shard_map's types is not):

* :func:`varying_of`, :func:`with_varying`: the mesh axes an aval varies over, kept in
  ``aval.mat.varying`` (a ``ManualAxisType``) and replaced through
  ``aval.update(manual_axis_type=...)`` in jax 0.10 and 0.11 (jax 0.9 and earlier called it
  ``aval.vma``; those are outside the bounds).

The distributed runtime (``jax._src``: no public path exists):

* :func:`distributed_state`: ``jax._src.distributed.global_state``, whose ``client`` is the
  job's key-value store (object send/recv, the watchdog's messages between processes),
  ``service`` tells whether this process hosts the coordinator, and ``process_id``/
  ``num_processes`` give this process's place without starting a backend. ``jaxcoll.init``
  clears ``client``/``service`` after a failed join so that a later one can try again.
* :func:`backends_are_initialized`: ``jax._src.xla_bridge.backends_are_initialized``, the only
  way to ask whether JAX has started its devices (after which it can no longer join a job)
  without starting them.
* :data:`ArrayImpl`: ``jax._src.array.ArrayImpl``, the concrete array type, so the watchdog can
  recognise a single-array result without flattening a pytree; None if it ever moves (the
  watchdog then flattens every result).
"""

from __future__ import annotations

from typing import Any

from jax._src import distributed as _distributed
from jax._src import xla_bridge as _xla_bridge
from jax.extend.core import ClosedJaxpr as ClosedJaxpr
from jax.extend.core import Jaxpr as Jaxpr
from jax.extend.core import Literal as Literal
from jax.extend.core import Primitive as Primitive
from jax.interpreters.ad import Zero as Zero
from jax.interpreters.ad import deflinear2 as deflinear2
from jax.interpreters.ad import instantiate_zeros as instantiate_zeros
from jax.interpreters.ad import primitive_jvps as primitive_jvps
from jax.interpreters.ad import primitive_transposes as primitive_transposes
from jax.interpreters.batching import fancy_primitive_batchers as fancy_primitive_batchers
from jax.interpreters.batching import primitive_batchers as primitive_batchers
from jax.interpreters.mlir import lower_fun as lower_fun
from jax.interpreters.mlir import register_lowering as register_lowering

ArrayImpl: type | None
try:
    from jax._src.array import ArrayImpl as _ArrayImpl

    ArrayImpl = _ArrayImpl
except ImportError:  # pragma: no cover - a JAX that moved it: callers fall back
    ArrayImpl = None

__all__ = [
    "CALLS",
    "ArrayImpl",
    "ClosedJaxpr",
    "Jaxpr",
    "Literal",
    "Primitive",
    "backends_are_initialized",
    "deflinear2",
    "distributed_state",
    "fancy_primitive_batchers",
    "Zero",
    "instantiate_zeros",
    "jaxpr_parts",
    "lower_fun",
    "lowering_platforms",
    "primitive_batchers",
    "primitive_jvps",
    "primitive_transposes",
    "register_lowering",
    "scan_counts",
    "varying_of",
    "with_varying",
]


#: Call-like primitives whose body FSDP enters, and the parameter that holds the body.
CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


def scan_counts(params: Any) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's parameters: its inputs are that
    many constants, then that many carries, then the scanned inputs; its body returns the
    carries, then the stacked outputs."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    # jax 0.11: ``ft_in`` is a flat tree of the inputs; unpacked, its three groups.
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def jaxpr_parts(inner: Any) -> tuple[Any, tuple]:
    """``(jaxpr, consts)`` of an equation's inner jaxpr, closed (``ClosedJaxpr``) or open."""
    if hasattr(inner, "jaxpr") and hasattr(inner, "consts"):
        return inner.jaxpr, tuple(inner.consts)
    return inner, ()


def lowering_platforms(ctx: Any) -> tuple[str, ...]:
    """Every platform the module being lowered is for, e.g. ``("cuda", "cpu")``.

    ``ctx`` is the context a lowering rule receives. A module lowered for several platforms
    (``jax.export(..., platforms=...)``) is compiled whole by each platform's compiler.
    """
    return tuple(ctx.module_context.platforms)


def varying_of(aval: Any) -> frozenset | None:
    """The mesh axes ``aval`` is typed varying over, or None for an aval without such types."""
    mat = getattr(aval, "mat", None)
    return getattr(mat, "varying", None)


def with_varying(aval: Any, axes: frozenset) -> Any:
    """``aval`` typed varying over exactly ``axes`` (invariant over the other mesh axes)."""
    return aval.update(manual_axis_type=aval.mat.update(varying=frozenset(axes)))


def distributed_state() -> Any:
    """JAX's distributed runtime state (``client``, ``service``, ``process_id``, ...)."""
    return _distributed.global_state


def backends_are_initialized() -> bool:
    """Whether JAX has started its backends (devices) in this process; starts nothing."""
    return _xla_bridge.backends_are_initialized()
