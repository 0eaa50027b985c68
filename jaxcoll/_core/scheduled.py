"""jaxcoll's own programs, compiled with their XLA options (:func:`jaxcoll._xla_flags.
compiler_options`) for themselves only.

``jax.jit(f, compiler_options=...)`` cannot be traced inside another jit (``jax.make_jaxpr``
of a Trainer's step, a user's jit calling it), so jaxcoll keeps its jits plain and compiles
them with the options where it runs them: :class:`Scheduled` wraps a plain jit, compiles it
once per argument signature (``jitted.lower(*args).compile(compiler_options=...)``) when
called with arrays, and is the plain jit itself under a trace.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .._xla_flags import compiler_options


def _signature(leaf: Any) -> Any:
    """What decides which executable a leaf needs: its shape, dtype and placement."""
    if isinstance(leaf, jax.Array):
        return (leaf.shape, leaf.dtype, leaf.sharding, leaf.weak_type)
    return (type(leaf), np.shape(leaf), np.asarray(leaf).dtype)


class Scheduled:
    """A plain ``jax.jit`` function run by executables compiled with jaxcoll's compile options.

    Called with arrays: the executable for their signature (compiled on first use, then
    reused). Called under a trace (inside another jit, ``jax.make_jaxpr``): the plain jit,
    as any nested jit. Anything else (``lower``, ``trace``, ...) is the plain jit's.
    """

    def __init__(self, jitted: Any) -> None:
        self.jitted = jitted
        self._compiled: dict[Any, Any] = {}
        # a profile names each run, as it names a jit's dispatch ``PjitFunction(name)``
        self._label = f"jaxcoll({getattr(jitted, '__name__', 'program')})"

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self.jitted(*args)
        key = (tree, tuple(_signature(x) for x in leaves))
        compiled = self._compiled.get(key)
        if compiled is None:
            lowered = self.jitted.lower(*args)
            compiled = lowered.compile(compiler_options=compiler_options())
            self._compiled[key] = compiled
        with jax.profiler.TraceAnnotation(self._label):
            return compiled(*args)

    def _cache_size(self) -> int:
        """The executables compiled so far (what ``jax.jit``'s own ``_cache_size`` counts)."""
        return len(self._compiled)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)
