"""Work: the handle an ``async_op=True`` call returns."""

from __future__ import annotations

import jax

from .._core.typing import PyTree


class Work:
    """The pending result of a collective issued with ``async_op=True``.

    Like torch's ``Work``. It is honest because JAX dispatch is already asynchronous: the call
    that returned this handle only enqueued the compiled collective, so Python code (and other
    device work) issued afterwards overlaps with it. No thread is involved.

    Example (8 devices)::

        >>> work = dist.all_reduce(dist.per_rank(np.arange(8.0)), async_op=True)
        >>> other = jnp.ones((512, 512)) @ jnp.ones((512, 512))   # overlaps the all_reduce
        >>> dist.to_ranks(work.wait())[0]
        array(28., dtype=float32)
    """

    def __init__(self, result: PyTree):
        self._result = result

    def wait(self) -> PyTree:
        """Block until every shard of the result is computed; return the result."""
        return jax.block_until_ready(self._result)

    def is_completed(self) -> bool:
        """True once every shard of every result array is ready. Never blocks."""
        return all(leaf.is_ready() for leaf in jax.tree_util.tree_leaves(self._result))

    def result(self) -> PyTree:
        """The result arrays, without waiting.

        JAX arrays are futures: passing them to further JAX calls orders those calls after the
        collective; converting them to NumPy (e.g. :func:`~jaxcoll.distributed.to_ranks`) waits.
        Call :meth:`wait` to block here instead.
        """
        return self._result

    def __repr__(self) -> str:
        return f"Work(completed={self.is_completed()})"
