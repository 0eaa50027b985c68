"""How an object passed as ``axis_name`` runs a collective itself (a group, for one).

Like NumPy's ``__array_function__``: a primitive that receives such an object calls its
``__jaxcoll_collective__(primitive, x, **kwargs)`` with itself (the public primitive function)
and its arguments, and returns what the object returns. The primitives thus never import the
types that implement it (:class:`jaxcoll.groups.Group` does). :func:`dispatch` writes that
hand-over once for every primitive, as NumPy's ``array_function_dispatch`` does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

METHOD = "__jaxcoll_collective__"

_P = ParamSpec("_P")
_R = TypeVar("_R")


def handler(axis_name: Any) -> Any:
    """The bound ``__jaxcoll_collective__`` of ``axis_name``, or None for a plain axis name."""
    if isinstance(axis_name, (str, tuple, list)) or axis_name is None:
        return None
    return getattr(axis_name, METHOD, None)


def dispatch(primitive: Callable[_P, _R]) -> Callable[_P, _R]:
    """``primitive``, handed to its ``axis_name``'s ``__jaxcoll_collective__`` when it has one.

    For a plain axis name (or tuple of names) the decorated function is ``primitive`` itself.
    Otherwise it calls the object's method with the decorated function, ``x`` (None for an op
    without one: ``rank``, ``world_size``) and every other argument by name, defaults filled
    in, and returns what the object returns.
    """
    signature = inspect.signature(primitive)
    at = list(signature.parameters).index("axis_name")

    @functools.wraps(primitive)
    def dispatched(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        own = handler(args[at] if len(args) > at else kwargs.get("axis_name"))
        if own is None:
            return primitive(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        del options["axis_name"]
        return own(dispatched, options.pop("x", None), **options)

    return dispatched
