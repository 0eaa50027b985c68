"""dist follows torch where it uses torch's names: new_group sorts, src/dst are global ranks.

torch's ``new_group(ranks)`` orders the ranks ascending; ``src=``/``dst=`` name GLOBAL ranks and
``group_src=``/``group_dst=`` ranks within the group. A ported script that uses groups must
broadcast from the rank torch would. The expectations are written out from torch's documented
semantics, independently of jaxcoll.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcoll import dist


def _values(group):
    """Row j of a per-rank array for ``group`` holds 100 + its global rank."""
    return dist.per_rank(lambda j: np.float32([100 + group.ranks[j]]), group)


def test_new_group_orders_ranks_as_torch():
    g = dist.new_group([6, 1, 5])
    assert g.ranks == (1, 5, 6)
    assert dist.ordered_group([6, 1, 5]).ranks == (6, 1, 5)


@pytest.mark.parametrize("src", [1, 5, 6])
def test_src_is_a_global_rank(src):
    g = dist.new_group([6, 1, 5])
    got = dist.to_ranks(dist.broadcast(_values(g), src=src, group=g))
    assert [float(v[0]) for v in got] == [100.0 + src] * 3


def test_group_src_is_a_rank_within_the_group():
    g = dist.new_group([6, 1, 5])  # group ranks 0, 1, 2 are global 1, 5, 6
    got = dist.to_ranks(dist.broadcast(_values(g), group=g, group_src=2))
    assert [float(v[0]) for v in got] == [106.0] * 3
    red = dist.to_ranks(dist.reduce(_values(g), dst=5, group=g))
    assert [float(v[0]) for v in red] == [101.0, 101.0 + 105 + 106, 106.0]
    gat = dist.to_ranks(dist.gather(_values(g), group=g, group_dst=0))
    assert gat[0][:, 0].tolist() == [101.0, 105.0, 106.0] and not gat[1].any()


def test_send_recv_take_global_ranks():
    g = dist.new_group([6, 1, 5])
    got = dist.to_ranks(dist.send(_values(g), dst=1, src=6, group=g))
    assert [float(v[0]) for v in got] == [106.0, 105.0, 106.0]
    same = dist.to_ranks(dist.recv(_values(g), src=6, dst=1, group=g))
    assert [float(v[0]) for v in same] == [106.0, 105.0, 106.0]


def test_seed_003_broadcast_with_a_group():
    """Seed 003's broadcast (rank 0 sends [1.] to a 4-process group), on the group of global
    ranks 4..7: torch's script would pass src=4, the group's first global rank."""
    g = dist.new_group([7, 4, 6, 5])
    tensor = dist.per_rank(lambda j: np.float32([1.0 if g.ranks[j] == 4 else 0.0]), g)
    out = dist.to_ranks(dist.broadcast(tensor, src=4, group=g))
    assert [v.tolist() for v in out] == [[1.0]] * 4
    scattered = dist.to_ranks(dist.scatter(
        dist.per_rank(lambda j: np.float32([1, 2, 3, 4]) * (g.ranks[j] == 4), g), src=4,
        group=g, tiled=True))
    assert [v.tolist() for v in scattered] == [[1.0], [2.0], [3.0], [4.0]]


def test_partition_groups_take_group_ranks():
    g = dist.new_subgroups(4)
    x = dist.per_rank(lambda r: np.float32([r]))
    got = dist.to_ranks(dist.broadcast(x, group=g, group_src=1))
    assert [float(v[0]) for v in got] == [1.0] * 4 + [5.0] * 4
    with pytest.raises(ValueError, match="partition"):
        dist.broadcast(x, src=1, group=g)
