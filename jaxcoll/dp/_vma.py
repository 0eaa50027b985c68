"""Varying-axis (vma) helpers for the step: the fix for the gradient trap.

Inside ``shard_map`` with ``check_vma=True`` (which every dp program keeps on), ``jax.grad`` of
replicated params already sums the gradient over the data axis. The step marks params varying
first, so the gradient it gets is the local one and the strategy's reduction is the only one.
"""

from __future__ import annotations

import jax

from .._core.typing import AxisName, PyTree
from .._core.vma import cast_varying


def axis_names(axis_name: AxisName) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def to_varying(tree: PyTree, names: tuple) -> PyTree:
    """Mark every leaf varying over ``names`` (the fix for the gradient trap).

    A no-op under ``check_vma=False``, where shard_map tracks no such type (and ``jax.grad``
    inserts no reduction in the first place).
    """
    return jax.tree_util.tree_map(lambda x: cast_varying(x, names), tree)

