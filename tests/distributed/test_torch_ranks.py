"""dist follows torch where it uses torch's names: new_group sorts, src/dst are global ranks.

torch's ``new_group(ranks)`` orders the ranks ascending; ``src=``/``dst=`` name GLOBAL ranks and
``group_src=``/``group_dst=`` ranks within the group. A ported script that uses groups must
broadcast from the rank torch would. The expectations are written out from torch's documented
semantics, independently of jaxcoll.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcoll import distributed as dist


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
    scattered = dist.to_ranks(
        dist.scatter(
            dist.per_rank(lambda j: np.float32([1, 2, 3, 4]) * (g.ranks[j] == 4), g),
            src=4,
            group=g,
            tiled=True,
        )
    )
    assert [v.tolist() for v in scattered] == [[1.0], [2.0], [3.0], [4.0]]


def test_partition_groups_take_group_ranks():
    g = dist.new_subgroups(4)
    x = dist.per_rank(lambda r: np.float32([r]))
    got = dist.to_ranks(dist.broadcast(x, group=g, group_src=1))
    assert [float(v[0]) for v in got] == [1.0] * 4 + [5.0] * 4
    with pytest.raises(ValueError, match="partition"):
        dist.broadcast(x, src=1, group=g)


def test_scatter_and_gather_default_to_global_rank_0():
    """torch's scatter and gather take global rank 0 when neither src/dst nor group_src/
    group_dst is given (PyTorch's test_scatter_checks / test_gather_checks call them so).
    Every row holds different data, so reading another rank would show."""
    x = dist.per_rank(lambda r: np.float32([10 * r + j for j in range(8)]))
    scattered = dist.to_ranks(dist.scatter(x))
    assert [float(v) for v in scattered] == [float(j) for j in range(8)]  # rank 0's row
    gathered = dist.to_ranks(dist.gather(dist.per_rank(lambda r: np.float32([100 + r]))))
    assert gathered[0][:, 0].tolist() == [100.0 + r for r in range(8)]
    assert not any(row.any() for row in gathered[1:])
    work = dist.gather(dist.per_rank(lambda r: np.float32([r])), async_op=True)
    assert dist.to_ranks(work.wait())[0][:, 0].tolist() == list(map(float, range(8)))


def test_the_default_root_is_global_rank_0_not_group_rank_0():
    """In a group where global rank 0 is group rank 1, the default root is group rank 1."""
    g = dist.ordered_group([3, 0, 5])
    gathered = dist.to_ranks(dist.gather(_values(g), group=g))
    assert gathered[1][:, 0].tolist() == [103.0, 100.0, 105.0]
    assert not gathered[0].any() and not gathered[2].any()
    x = dist.per_rank(lambda j: np.float32([1, 2, 3]) * (10**j), g)
    assert [float(v) for v in dist.to_ranks(dist.scatter(x, group=g))] == [10.0, 20.0, 30.0]
    ragged = dist.gather_uneven(
        dist.per_rank(lambda j: np.float32([g.ranks[j]] * 2), g), [1, 2, 1], group=g
    )
    assert [dist.to_ranks(t)[1].tolist() for t in ragged] == [[3.0], [0.0, 0.0], [5.0]]
    assert not dist.to_ranks(ragged[0])[0].any()


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda x, g: dist.gather(x, group=g),
            r"dist.gather: Global rank 0 is not part of group Group\(ranks=\[1, 5, 6\].*; dst=0 is "
            r"torch's default when neither dst= nor group_dst= is given. Pass a member's",
        ),
        (
            lambda x, g: dist.scatter(x, group=g),
            r"dist.scatter: Global rank 0 is not part of group .*; src=0 is torch's default",
        ),
        (
            lambda x, g: dist.gather_uneven(x, [1, 1, 1], group=g),
            r"dist.gather_uneven: Global rank 0 is not part of group .*; dst=0 is torch's "
            r"default",
        ),
    ],
)
def test_the_default_root_outside_the_group_is_torchs_error(call, match):
    g = dist.new_group([6, 1, 5])
    with pytest.raises(ValueError, match=match):
        call(dist.per_rank(lambda j: np.zeros((3, 1), np.float32), g), g)


def test_a_partition_needs_group_src_even_by_default():
    x = dist.per_rank(lambda r: np.zeros(2, np.float32))
    with pytest.raises(
        ValueError,
        match=r"dist.scatter: src=0 \(torch's default when neither "
        r"src= nor group_src= is given\) names one global "
        r"rank, but .* partition",
    ):
        dist.scatter(x, group=dist.new_subgroups(2))
    with pytest.raises(
        ValueError,
        match=r"dist.broadcast: pass src= \(a global rank\) or "
        r"group_src=",
    ):
        dist.broadcast(x)  # torch's broadcast has no default src
