"""Varying-axis (vma) helpers for the trainer: the fix for the gradient trap.

Inside ``shard_map`` with ``check_vma=True``, ``jax.grad`` of replicated params already sums the
gradient over the data axis. The trainer marks params varying first, so the gradient it gets is
the local one and its own (bucketed) reduction is the only one.
"""

from __future__ import annotations

import jax
from jax import lax

from .._typing import AxisName, PyTree
from ..primitives._lowering import varying_axes


def axis_names(axis_name: AxisName) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def to_varying(tree: PyTree, names: tuple) -> PyTree:
    """Mark every leaf varying over ``names`` (the fix for the gradient trap).

    A no-op under ``check_vma=False``, where shard_map tracks no such type (and ``jax.grad``
    inserts no reduction in the first place).
    """
    if not checking_vma(names):
        return tree

    def cast(x):
        vma = varying_axes(x)
        missing = tuple(a for a in names if vma is not None and a not in vma)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(cast, tree)


def checking_vma(names: tuple) -> bool:
    """Whether the enclosing shard_map tracks varying axes (check_vma=True)."""
    probe = lax.axis_index(names[0] if len(names) == 1 else names)
    return bool(set(names) & set(varying_axes(probe) or ()))


def is_varying(tree: PyTree, names: tuple) -> bool:
    return any(bool(set(names) & set(varying_axes(x) or ()))
               for x in jax.tree_util.tree_leaves(tree))
