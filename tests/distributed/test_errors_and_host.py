"""Error paths (ValueError/TypeError naming the call and the fix) and the host-level helpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcoll import distributed as dist


def test_per_rank_round_trip_and_row_order() -> None:
    g = dist.new_group([5, 1])
    rows = [np.arange(3, dtype=np.int32), np.arange(3, 6, dtype=np.int32)]
    x = dist.per_rank(rows, g)
    assert x.shape == (2, 3) and x.dtype == np.int32
    got = dist.to_ranks(x)
    assert [r.tolist() for r in got] == [[0, 1, 2], [3, 4, 5]]
    # torch's new_group orders the ranks: row 0 is global rank 1, row 1 global rank 5
    assert {s.device.id: int(np.asarray(s.data)[0, 0]) for s in x.addressable_shards} == {
        jax.devices()[1].id: 0,
        jax.devices()[5].id: 3,
    }
    f = dist.per_rank(lambda r: np.float32(r * 10))
    assert [float(v) for v in dist.to_ranks(f)] == [r * 10.0 for r in range(8)]


def test_host_queries_and_objects() -> None:
    assert dist.get_world_size() == 8
    assert dist.get_world_size(dist.hierarchy(2).node) == 4
    assert dist.local_ranks(dist.new_group([7, 3])) == [0, 1]
    assert dist.is_initialized() is False
    obj = {"lr": 0.1, "tags": ["a", "b"]}
    assert dist.broadcast_object(obj) == obj
    assert dist.all_gather_object(obj) == [obj]
    assert dist.new_subgroups(4).subgroups == ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: dist.new_group([]), ValueError, r"new_group: ranks=\[\] is empty"),
        (lambda: dist.new_group([1, 2, 1]), ValueError, r"new_group: .*repeats rank 1"),
        (lambda: dist.new_group([0, 8]), ValueError, r"new_group: rank 8 .* out of range"),
        (lambda: dist.new_group("01"), TypeError, r"new_group: ranks must be a sequence"),
        (
            lambda: dist.new_subgroups(3),
            ValueError,
            r"new_subgroups: group_size=3 does not divide the world of 8 ranks.*\[1, 2, 4, 8\]",
        ),
        (lambda: dist.hierarchy(0), ValueError, r"hierarchy: local_size=0 does not divide"),
        (
            lambda: dist.per_rank([np.zeros(2)] * 3),
            ValueError,
            r"per_rank: got 3 values but the group has 8 rows",
        ),
        (
            lambda: dist.per_rank(lambda r: np.int64([2**40 + 1])),
            ValueError,
            r"per_rank: row 0 holds int64 values that int32 cannot hold.*jax_enable_x64",
        ),
        (
            lambda: dist.per_rank(lambda r: np.uint64([2**33])),
            ValueError,
            r"per_rank: row 0 holds uint64 values that uint32 cannot hold.*jax_enable_x64",
        ),
        (
            lambda: dist.per_rank(lambda r: np.float64([1e300])),
            ValueError,
            r"per_rank: row 0 holds float64 values that float32 cannot hold",
        ),
        (
            lambda: dist.per_rank(lambda r: np.zeros(r % 2 + 1)),
            ValueError,
            r"per_rank: row 1 has shape \(2,\)",
        ),
        (
            lambda: dist.all_reduce(dist.per_rank(np.zeros(8)), group=dist.new_group([0, 1])),
            ValueError,
            r"dist.all_reduce: x has 8 rows but the group .* has 2 rows",
        ),
        (
            lambda: dist.all_reduce(jnp.zeros(8)),
            ValueError,
            r"dist.all_reduce: x is not placed one row per rank",
        ),
        (
            lambda: dist.all_reduce(np.zeros(8)),
            TypeError,
            r"dist.all_reduce: x must be a per-rank jax.Array.*dist.per_rank",
        ),
        (
            lambda: dist.broadcast(dist.per_rank(np.zeros(8)), src=8),
            ValueError,
            r"dist.broadcast: Global rank 8 is not part of group",
        ),
        (
            lambda: dist.reduce(
                dist.per_rank(np.zeros(3)[:, None].repeat(1, 1), dist.new_group([1, 5, 6])),
                dst=3,
                group=dist.new_group([1, 5, 6]),
            ),
            ValueError,
            r"dist.reduce: Global rank 3 is not part of group .*\[1, 5, 6\].*group_dst=",
        ),
        (
            lambda: dist.send(dist.per_rank(np.zeros(8)), dst=0, src=-1),
            ValueError,
            r"dist.send: Global rank -1 is not part of group",
        ),
        (
            lambda: dist.broadcast(dist.per_rank(np.zeros(8)), src=1, group_src=1),
            ValueError,
            r"dist.broadcast: pass src= \(a global rank\) or group_src= .* not both",
        ),
        (
            lambda: dist.reduce(dist.per_rank(np.zeros(8))),
            ValueError,
            r"dist.reduce: pass dst= \(a global rank\) or group_dst=",
        ),  # torch: no default
        (
            lambda: dist.scatter(dist.per_rank(np.zeros(8)), src=2, group=dist.new_subgroups(2)),
            ValueError,
            r"dist.scatter: src=2 names one global rank, but .* partition.*group_src=",
        ),
        (
            lambda: dist.reduce(dist.per_rank(np.zeros(8)), group_dst=8),
            ValueError,
            r"dist.reduce: group_dst=8 is out of range for a group of 8 ranks",
        ),
        (
            lambda: dist.sendrecv(dist.per_rank(np.zeros(8)), [(0, 1), (2, 1)]),
            ValueError,
            r"dist.sendrecv: .*rank 1 receives more than once",
        ),
        (
            lambda: dist.all_reduce(dist.per_rank(np.zeros(8, np.int32)), op="avg"),
            TypeError,
            r"dist.all_reduce: op=ReduceOp.AVG is not defined for dtype int32",
        ),
        (
            lambda: dist.all_reduce(dist.per_rank(np.zeros(8)), op="mode"),
            ValueError,
            r"dist.all_reduce: op='mode' is not a reduce op",
        ),
        (
            lambda: dist.all_reduce(dist.per_rank(np.zeros(8)), group=[0, 1]),
            TypeError,
            r"dist.all_reduce: group must be a Group",
        ),
        (
            lambda: dist.broadcast_object(1, src=1),
            ValueError,
            r"dist.broadcast_object: src=1 is out of range for a group of 1",
        ),
    ],
)
def test_errors(call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_values_that_fit_are_accepted() -> None:
    """Python ints and floats arrive as 64-bit NumPy values; those that fit are held as is."""
    x = dist.per_rank(lambda r: np.int64([r, 2**31 - 1]))
    assert x.dtype == np.int32 and dist.to_ranks(x)[7].tolist() == [7, 2**31 - 1]
    f = dist.per_rank(lambda r: np.float64([0.1 * r]))
    assert f.dtype == np.float32
