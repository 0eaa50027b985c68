"""Type aliases shared by jaxcoll's public signatures."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, TypeAlias

PyTree: TypeAlias = Any
"""A pytree of arrays (a single array, or nested lists/tuples/dicts of them)."""

AxisName: TypeAlias = Hashable | tuple[Hashable, ...]
"""A mesh axis name, or a tuple of them (the collective runs over their product)."""
