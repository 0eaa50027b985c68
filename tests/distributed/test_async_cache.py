"""Async handles are honest and repeated calls reuse the compiled program."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcoll import distributed as dist
from jaxcoll.distributed import _collectives


def test_async_all_reduce_returns_before_it_completes() -> None:
    # 8 x 2M float32 with PRODUCT (all_to_all + fold + all_gather): tens of milliseconds on CPU.
    x = dist.per_rank(lambda r: np.full((1 << 21,), 1.0 + r / 8, np.float32))
    dist.all_reduce(x, op="product", async_op=True).wait()  # compile outside the measurement
    work = dist.all_reduce(x, op="product", async_op=True)
    assert not work.is_completed(), "dispatch waited for the collective to finish"
    busy = np.linalg.svd(np.ones((64, 64)))[1].sum()  # host work issued after the collective
    out = work.wait()
    assert work.is_completed()
    assert out is work.result()
    want = np.prod(np.arange(8, 16, dtype=np.float64) / 8)
    got = dist.to_ranks(out)
    assert all(np.allclose(row[:3], want, rtol=1e-5) for row in got)
    assert busy > 0


def test_second_identical_call_does_not_trace_again() -> None:
    g = dist.new_group([3, 1])
    x = dist.per_rank([np.arange(4.0), np.ones(4)], g)
    traces = _collectives.TRACES
    dist.all_reduce(x, op="max", group=g)
    first = traces["all_reduce"]
    for _ in range(3):
        y = dist.all_reduce(x, op="max", group=g)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=dist.new_group([3, 1]), async_op=True)
    assert traces["all_reduce"] == first
    np.testing.assert_array_equal(dist.to_ranks(y)[0], [1.0, 1.0, 2.0, 3.0])
    # the counter can move: another shape or another option traces once more
    dist.all_reduce(dist.per_rank([np.arange(5.0), np.ones(5)], g), op="max", group=g)
    assert traces["all_reduce"] == first + 1
    dist.all_reduce(x, op="min", group=g)
    assert traces["all_reduce"] == first + 2


@pytest.mark.parametrize("async_op", [False, True])
def test_barrier_and_send_helpers(async_op: bool) -> None:
    g = dist.new_group([4, 2, 7])
    x = dist.per_rank([np.float32(v) for v in (10, 20, 30)], g)
    out = dist.sendrecv(x, [(0, 2), (2, 0)], group=g, async_op=async_op)
    if async_op:
        out = out.wait()
    assert [float(v) for v in dist.to_ranks(out)] == [30.0, 20.0, 10.0]
    assert dist.barrier(g) is None
