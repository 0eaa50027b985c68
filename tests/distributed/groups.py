"""The groups every dist test runs on, with their layout written out independently of jaxcoll.

``rows``: per subgroup, the rows of a per-rank array in group-rank order.
``devices``: the global device index of each row.
"""

from __future__ import annotations

from jaxcoll import distributed as dist

EIGHT = list(range(8))

GROUPS = {
    "world": (lambda: dist.world(), [EIGHT], EIGHT),
    "size1": (lambda: dist.new_group([2]), [[0]], [2]),
    "size3": (lambda: dist.new_group([1, 5, 6]), [[0, 1, 2]], [1, 5, 6]),
    "size4": (lambda: dist.new_group([6, 0, 3, 4]), [[0, 1, 2, 3]], [0, 3, 4, 6]),  # sorted
    "ordered4": (lambda: dist.ordered_group([6, 0, 3, 4]), [[0, 1, 2, 3]], [6, 0, 3, 4]),
    "sub2": (lambda: dist.new_subgroups(2), [[0, 1], [2, 3], [4, 5], [6, 7]], EIGHT),
    "node": (lambda: dist.hierarchy(4).node, [[0, 4], [1, 5], [2, 6], [3, 7]], EIGHT),
    "local": (lambda: dist.hierarchy(4).local, [[0, 1, 2, 3], [4, 5, 6, 7]], EIGHT),
}


def expected(rows, xs, fn):
    """Apply a per-group oracle ``fn(list of member inputs) -> list of outputs`` per subgroup."""
    out = [None] * len(xs)
    for sub in rows:
        for r, y in zip(sub, fn([xs[i] for i in sub]), strict=True):
            out[r] = y
    return out
