"""The repeated blocks of a param tree: an unrolled model's layers, as FSDP's units."""

from __future__ import annotations

from typing import Any

import jax


def block_units(params: Any) -> list[int | None]:
    """Per leaf of ``params`` (in ``jax.tree_util`` order), the repeated block it belongs to
    (a number of its own per block), or None.

    A block is one of two or more siblings in the tree with the same structure, shapes and
    dtypes: subtrees (``{"h_0": {...}, "h_1": {...}}``, a list of layer dicts: an unrolled
    model's blocks, as torch's FSDP wraps each layer of a class in a unit of its own) or
    the leaves of a list (a list of weight matrices; a dict's equal leaves, a norm's scale
    and bias, are not blocks); the shallowest such siblings on a path are the blocks, the
    leaves under none get None. FSDP gathers no group of params across two blocks
    (:func:`_groups`).
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    paths = [tuple(p) for p, _ in flat]
    kinds = [(tuple(jax.numpy.shape(x)), jax.numpy.result_type(x)) for _, x in flat]
    units: list[int | None] = [None] * len(flat)
    count = 0

    def visit(idx: list[int], depth: int) -> None:
        nonlocal count
        children: dict[Any, list[int]] = {}
        for i in idx:
            if len(paths[i]) > depth:
                children.setdefault(paths[i][depth], []).append(i)
        sig = {k: tuple((paths[i][depth + 1 :], kinds[i]) for i in c) for k, c in children.items()}
        same: dict[Any, int] = {}
        for v in sig.values():
            same[v] = same.get(v, 0) + 1
        for k, c in children.items():
            leaf = len(c) == 1 and len(paths[c[0]]) == depth + 1
            if same[sig[k]] >= 2 and (not leaf or isinstance(k, jax.tree_util.SequenceKey)):
                for i in c:
                    units[i] = count
                count += 1
            elif not leaf:
                visit(c, depth + 1)

    visit(list(range(len(flat))), 0)
    return units
