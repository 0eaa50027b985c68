"""The communication-hook interface: one bucket of local gradients in, their mean out.

DDP's ``register_comm_hook(state, hook)`` is the model; ``sync=dp.sync.DDP(hook=hook)`` is how
a hook is given. A hook is called once per bucket per step, per rank, inside the step's
``jax.shard_map``; it receives a :class:`Bucket` (this rank's local gradients of the bucket's
leaves, the data axis, the step) and its own state for that bucket, and returns the bucket's
gradients averaged over the ranks, equal on every rank, and its new state. The state is
carried in the train state (:attr:`TrainState.comm_state <jaxcoll.dp.TrainState.comm_state>`):
one pytree per bucket and per rank, checkpointed with the rest, so a resumed run continues
bit-identically.

The interface is typed (:class:`CommHook`): any callable ``hook(state, bucket) -> (grads,
state)`` is a hook; one that keeps state also has ``init(shapes, index) -> state``
(:class:`StatefulHook`: the bucket's gradient shapes as ``jax.ShapeDtypeStruct``; the same
initial state on every rank); one whose program changes with the step number has
``phase(step) -> hook`` (:class:`PhasedHook`; the strategy compiles one program per phase).
:class:`AllReduceHook` (DDP's default ``allreduce_hook``) and :class:`Compress`
(``bf16_compress_hook`` / ``fp16_compress_hook``) are the built-ins besides
:class:`~jaxcoll.dp.hooks.PowerSGD`.

Writing a hook: this one averages as DDP does and counts, per bucket and per rank, the steps
whose mean held an inf or a NaN (``state.comm_state[k]`` after training; with
``skip_nonfinite=True`` a skipped step keeps the old count, as it keeps the old params).
The means a hook returns must be typed invariant (equal on every rank): compute them from
what :meth:`Bucket.sum` or :meth:`Bucket.mean` returned, never from the state, which
arrives typed varying (one copy per rank)::

    import jax.numpy as jnp

    class CountNonFinite:  # DDP's mean; the state counts the steps whose mean was not finite
        def init(self, shapes, index):  # outside shard_map: the same on every rank
            return jnp.zeros((), jnp.int32)

        def __call__(self, count, bucket):  # per bucket and per rank, inside shard_map
            # Gradients cross devices here: the bucket's g / n, summed in one all-reduce.
            means = bucket.sum([g / bucket.n for g in bucket.grads])
            finite = jnp.stack([jnp.isfinite(m).all() for m in means]).all()
            return means, count + (~finite).astype(jnp.int32)

    trainer = dp.Trainer(loss_fn, optax.sgd(0.1), sync=dp.sync.DDP(hook=CountNonFinite()))

``tests/dp/test_hooks.py`` runs this example.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from ... import primitives
from ..._core.packing import pack, unpack
from ..._core.typing import AxisName, PyTree
from ...algorithms.registry import resolve


@dataclass(frozen=True)
class Bucket:
    """What a hook sees of one bucket, on one rank, inside ``jax.shard_map``.

    Attributes:
        grads: this rank's local gradients of the bucket's leaves (each the gradient of the
            rank's per-example-mean loss: their mean over ranks is the global gradient),
            typed varying over the data axis.
        index: the bucket's position in DDP's order (0 holds the last leaves of the params).
        axis_name: the data axis (or tuple of axes) to reduce over.
        n: the number of ranks.
        algorithm: the collective algorithm of the strategy (``dp.sync.DDP(algorithm=...)``).
        step: the number of optimizer steps taken before this one (an int32 scalar, the same
            on every rank).
    """

    grads: tuple[jax.Array, ...]
    index: int
    axis_name: AxisName
    n: int
    algorithm: str
    step: jax.Array

    def sum(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
        """Each array summed over the ranks, all of them in ONE collective (typed invariant).

        The arrays must share a dtype. With the native algorithm one ``lax.psum`` of the
        tuple; otherwise they are packed into one flat buffer for one
        :func:`jaxcoll.primitives.all_reduce` with the bucket's algorithm.
        """
        return sum_together(list(arrays), self.axis_name, self.n, self.algorithm)

    def mean(self, dtype: DTypeLike | None = None) -> list[jax.Array]:
        """DDP's default hook: each gradient divided by n (in ``dtype`` on the wire when
        given), summed over the ranks in one collective, cast back to its own dtype."""
        parts = list(self.grads)
        wire = [(g / jnp.asarray(self.n, g.dtype)).astype(dtype or g.dtype) for g in parts]
        return [t.astype(g.dtype) for t, g in zip(self.sum(wire), parts, strict=True)]


def sum_together(
    parts: list[jax.Array], axis_name: AxisName, n: int, algorithm: str
) -> list[jax.Array]:
    """Sum ``parts`` over ranks with one collective (one dtype), typed invariant."""
    if not parts:
        return []
    nbytes = sum(p.size * p.dtype.itemsize for p in parts)
    algorithm = resolve(
        "all_reduce", algorithm, nbytes, group_size=n, two_level=isinstance(axis_name, tuple)
    )
    if algorithm == "native":
        # jaxcoll's native SUM is lax.psum: one psum of the tuple, lowered to one all-reduce
        # per operand, which XLA's all-reduce combiner merges.
        return list(lax.psum(tuple(parts), axis_name))
    # Gradients cross devices here: one collective for the whole bucket.
    total = primitives.all_reduce(pack(parts), axis_name, "sum", algorithm=algorithm)
    return unpack(total, parts)


@runtime_checkable
class CommHook(Protocol):
    """A communication hook: ``hook(state, bucket) -> (means, state)`` (DDP's
    ``register_comm_hook``), given as ``dp.sync.DDP(hook=...)``.

    Called once per bucket per step, per rank, inside the step's ``shard_map``, with the
    hook's state for that bucket (``()`` for a hook without :meth:`~StatefulHook.init`) and
    the :class:`Bucket`. Returns one mean per gradient of the bucket, each in that gradient's
    shape and dtype and typed invariant (equal on every rank), and the bucket's new state.
    """

    def __call__(self, state: PyTree, bucket: Bucket) -> tuple[Sequence[jax.Array], PyTree]: ...


@runtime_checkable
class StatefulHook(CommHook, Protocol):
    """A hook that keeps state between steps (:class:`~jaxcoll.dp.hooks.PowerSGD`)."""

    def init(self, shapes: Sequence[jax.ShapeDtypeStruct], index: int) -> PyTree:
        """The initial state of bucket ``index`` whose gradients have ``shapes`` (called
        outside ``shard_map``: the same on every rank)."""
        ...


@runtime_checkable
class PhasedHook(CommHook, Protocol):
    """A hook whose program depends on the step number, known on the host (PowerSGD: exact
    before ``start_iter``, compressed after). The strategy compiles one step program per
    phase and picks it before each step, so no ``lax.cond`` switches inside the program."""

    def phase(self, step: int) -> CommHook:
        """The hook (a hashable value: it keys the compiled programs) that runs step
        ``step``; it shares this hook's state."""
        ...


class AllReduceHook:
    """DDP's default (``allreduce_hook``): the exact mean, in the gradients' own dtype."""

    def init(self, shapes: Sequence[jax.ShapeDtypeStruct], index: int) -> PyTree:
        return ()

    def __call__(self, state: PyTree, bucket: Bucket) -> tuple[list[jax.Array], PyTree]:
        return bucket.mean(), state

    wire_dtype = None

    def __repr__(self) -> str:
        return "AllReduceHook()"


@dataclass(frozen=True)
class Compress:
    """The gradients travel in ``dtype`` (DDP's ``bf16_compress_hook`` with ``jnp.bfloat16``,
    ``fp16_compress_hook`` with ``jnp.float16``): each divided by n, cast, summed over the
    ranks, cast back; the update itself stays in the params' dtype. Stateless.

    ``sync=dp.sync.DDP(hook=Compress(jnp.bfloat16))``. The only hook that
    :class:`~jaxcoll.dp.sync.ZeRO1` and :class:`~jaxcoll.dp.sync.FSDP` accept besides the
    default: their reduce-scatters travel in ``dtype`` too.
    """

    dtype: DTypeLike

    def __post_init__(self) -> None:
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise TypeError(
                f"dp.hooks.Compress: dtype must be a floating dtype such as "
                f"jnp.bfloat16, got {self.dtype!r} instead."
            )
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    @property
    def wire_dtype(self) -> DTypeLike:
        return self.dtype

    def init(self, shapes: Sequence[jax.ShapeDtypeStruct], index: int) -> PyTree:
        return ()

    def __call__(self, state: PyTree, bucket: Bucket) -> tuple[list[jax.Array], PyTree]:
        return bucket.mean(self.dtype), state


def init_state(hook: CommHook, shapes: Sequence[jax.ShapeDtypeStruct], index: int) -> PyTree:
    """``hook.init(shapes, index)``, or ``()`` for a hook without state."""
    return hook.init(tuple(shapes), index) if isinstance(hook, StatefulHook) else ()


def wire_dtype(hook: CommHook) -> DTypeLike | None:
    """The dtype a reduce-scatter travels in for ``hook``, for the sharded strategies, which
    accept only the default hook and :class:`Compress`; None: the gradients' own."""
    return getattr(hook, "wire_dtype", None)


def is_elementwise(hook: CommHook | None) -> bool:
    """Whether ``hook`` is the default or :class:`Compress` (what a reduce-scatter can do)."""
    return hook is None or isinstance(hook, (AllReduceHook, Compress))


def check_hook(api: str, hook: Any) -> CommHook | None:
    """``hook`` must be None or a :class:`CommHook` (a callable)."""
    if hook is not None and not isinstance(hook, CommHook):
        raise TypeError(
            f"{api}: hook must be a communication hook (a callable hook(state, "
            f"bucket) -> (grads, state), e.g. dp.hooks.PowerSGD(rank=4)) or None, "
            f"got {hook!r} of type {type(hook).__name__} instead."
        )
    return hook
