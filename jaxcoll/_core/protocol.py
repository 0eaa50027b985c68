"""How an object passed as ``axis_name`` runs a collective itself (a group, for one).

Like NumPy's ``__array_function__``: a primitive that receives such an object calls its
``__jaxcoll_collective__(primitive, x, **kwargs)`` with itself (the public primitive function)
and its arguments, and returns what the object returns. The primitives thus never import the
types that implement it (:class:`jaxcoll.groups.Group` does).
"""

from __future__ import annotations

from typing import Any

METHOD = "__jaxcoll_collective__"


def handler(axis_name: Any) -> Any:
    """The bound ``__jaxcoll_collective__`` of ``axis_name``, or None for a plain axis name."""
    if isinstance(axis_name, (str, tuple, list)) or axis_name is None:
        return None
    return getattr(axis_name, METHOD, None)
