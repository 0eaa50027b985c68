"""Type aliases shared by jaxcoll's public signatures."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol, TypeAlias

import numpy as np

PyTree: TypeAlias = Any
"""A pytree of arrays (a single array, or nested lists/tuples/dicts of them)."""

AxisName: TypeAlias = Hashable | tuple[Hashable, ...]
"""A mesh axis name, or a tuple of them (the collective runs over their product)."""


class Shaped(Protocol):
    """Anything with a shape and a dtype: a ``jax.Array``, a NumPy array or a
    ``jax.ShapeDtypeStruct`` (what planning code reads of a leaf without its values)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...
