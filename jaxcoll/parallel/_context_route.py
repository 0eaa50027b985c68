"""``jax.nn.dot_product_attention`` through the context role: the attention models already
call, computed over a sequence split across the context axis (torch's ``context_parallel``
replaces ``scaled_dot_product_attention`` the same way).

:func:`dot_product_attention` has ``jax.nn.dot_product_attention``'s signature; where the
context role is bound it is :func:`~jaxcoll.parallel.context_attention` by the layout's
method, elsewhere the original. :func:`routed` puts it in ``jax.nn``'s place for a block,
where a binding gives the context role an axis; a ``dp.Trainer`` enters it while it traces
its step (``roles.ON_TRACE``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .._core import roles
from .._core.roles import Role
from .axes import bound_axis
from .context import Ring, context_attention

#: ``jax.nn.dot_product_attention`` as jax defines it, taken when jaxcoll.parallel is imported.
ORIGINAL: Callable[..., Any] = jax.nn.dot_product_attention

_API = "parallel.dot_product_attention"


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
) -> Any:
    """``jax.nn.dot_product_attention``, over the whole sequence where the context role is
    bound.

    Equivalent to::

        def dot_product_attention(query, key, value, ..., scale=None, is_causal=False, ...):
            if the context role's axis is bound here:   # each device: its part of the sequence
                return parallel.context_attention(query, key, value, Role.CONTEXT,
                                                  method=roles.context_method() or Ring(),
                                                  causal=is_causal, scale=scale)
            return jax.nn.dot_product_attention(query, key, value, ...)   # jax's own

    Shapes as jax's: query ``(B, T, N, H)``, key and value ``(B, S, K, H)``, ``N`` a
    multiple of ``K`` (grouped-query attention); under the context role ``T == S``, this
    device's tokens in the load-balanced order (:func:`~jaxcoll.parallel.to_context_order`).

    Args:
        query: the queries.
        key: the keys.
        value: the values.
        bias: jax's; under the context role, None only.
        mask: jax's; under the context role, None only (``is_causal`` is the mask it takes).
        scale: the scores' scale (default ``1 / sqrt(H)``).
        is_causal: each position attends to itself and the positions before it.
        query_seq_lengths: jax's; under the context role, None only.
        key_value_seq_lengths: jax's; under the context role, None only.
        local_window_size: jax's; under the context role, None only.
        implementation: jax's; under the context role, None only.
        return_residual: jax's; under the context role, False only.

    Returns:
        The attention's output, shaped as ``query`` (jax's, with ``return_residual``).

    Raises:
        ValueError: under the context role, an argument other than ``scale`` and
            ``is_causal`` given (attention over a split sequence supports only the causal
            mask).
    """
    if bound_axis(Role.CONTEXT, _API) is None:
        extra = {"return_residual": True} if return_residual else {}
        return ORIGINAL(
            query,
            key,
            value,
            bias,
            mask,
            scale=scale,
            is_causal=is_causal,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size,
            implementation=implementation,
            **extra,
        )
    refused = {
        "bias": bias,
        "mask": mask,
        "query_seq_lengths": query_seq_lengths,
        "key_value_seq_lengths": key_value_seq_lengths,
        "local_window_size": local_window_size,
        "implementation": implementation,
        "return_residual": return_residual or None,
    }
    for arg, value_given in refused.items():
        if value_given is not None:
            shape = getattr(value_given, "shape", None)
            shown = f"<an array of shape {tuple(shape)}>" if shape is not None else None
            raise ValueError(
                f"{_API} (jax.nn.dot_product_attention under a context layout): "
                f"{arg}={shown or repr(value_given)} is not supported: attention over a "
                f"sequence split across the context axis supports only is_causal (and scale). "
                f"Drop {arg} (a causal mask is is_causal=True), or use a layout without a "
                f"context role."
            )
    method = roles.context_method() or Ring()
    return context_attention(
        query, key, value, Role.CONTEXT, method=method, causal=is_causal, scale=scale
    )


@contextlib.contextmanager
def routed(binding: roles.Binding | None) -> Iterator[None]:
    """For the block, ``jax.nn.dot_product_attention`` is :func:`dot_product_attention`,
    where ``binding`` gives the context role an axis (else nothing changes); restored after,
    exceptions included.

    Model code calling ``jax.nn.dot_product_attention(...)`` at trace time is routed; a name
    bound before the block (``from jax.nn import dot_product_attention``) is not. The
    replacement is process-wide for the block: enter it around tracing, as a ``dp.Trainer``
    does (it is registered in ``roles.ON_TRACE``).

    Example (8 devices, ``("data", "context")`` a 2 x 4 mesh)::

        >>> binding = roles.Binding({"context": "context"})
        >>> def model(q, k, v):                   # this device's part of each sequence
        ...     return jax.nn.dot_product_attention(q, k, v, is_causal=True)
        >>> with roles.bound(binding), routed(binding):
        ...     out = jax.jit(jax.shard_map(model, mesh=mesh, in_specs=spec,
        ...                                 out_specs=spec))(q, k, v)
    """
    if binding is None or binding.axes.get(Role.CONTEXT.value) is None:
        yield
        return
    before = jax.nn.dot_product_attention
    jax.nn.dot_product_attention = dot_product_attention  # type: ignore[assignment]
    try:
        yield
    finally:
        jax.nn.dot_product_attention = before


roles.ON_TRACE.append(routed)
