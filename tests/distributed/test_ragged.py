"""dist.all_to_all_single (with and without split sizes), dist.all_gather_uneven,
dist.gather_uneven, dist.reduce_scatter_uneven, dist.scan and dist.exscan: torch's documented
answers, a NumPy oracle on groups of 1, 2, 3, 4 and 8 ranks (sorted, ordered, partitions), and
every error."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcoll import distributed as dist
from jaxcoll.distributed import _ragged
from tests.distributed.groups import GROUPS, expected
from tests.primitives import oracle


def test_all_to_all_single_uneven_is_torchs_documented_example():
    """The uneven example of torch.distributed.all_to_all_single's docstring, verbatim."""
    g = dist.new_group([0, 1, 2, 3])
    inputs = [list(range(0, 6)), list(range(10, 19)), list(range(20, 25)), list(range(30, 37))]
    x = dist.per_rank(lambda r: np.array(inputs[r] + [-1] * (9 - len(inputs[r])), np.int32), g)
    input_splits = [[2, 2, 1, 1], [3, 2, 2, 2], [2, 1, 1, 1], [2, 2, 2, 1]]
    output_splits = [[2, 3, 2, 2], [2, 2, 1, 2], [1, 2, 1, 2], [1, 2, 1, 1]]
    y = dist.all_to_all_single(x, output_splits, input_splits, group=g)
    torch_output = [
        [0, 1, 10, 11, 12, 20, 21, 30, 31],
        [2, 3, 13, 14, 22, 32, 33],
        [4, 15, 16, 23, 34, 35],
        [5, 17, 18, 24, 36],
    ]
    assert y.shape == (4, 9)
    for r, row in enumerate(dist.to_ranks(y)):
        k = sum(output_splits[r])
        assert row[:k].tolist() == torch_output[r]
        assert (row[k:] == 0).all()  # padding


def test_all_to_all_single_even_is_torchs_documented_example():
    g = dist.new_group([0, 1, 2, 3])
    x = dist.per_rank(lambda r: np.arange(4, dtype=np.int32) + 4 * r, g)
    got = [row.tolist() for row in dist.to_ranks(dist.all_to_all_single(x, group=g))]
    assert got == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def _tables(n_rows: int, k: int, seed: int):
    """Random consistent split tables for a group of k ranks per subgroup."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 3, (n_rows, k))


@pytest.mark.parametrize("gname", ["world", "size1", "size3", "ordered4", "sub2"])
def test_all_to_all_single_matches_numpy_on_groups(gname):
    make, rows, devices = GROUPS[gname]
    g = make()
    n_rows, k = len(devices), g.size
    width = 2 * k
    ins = _tables(n_rows, k, n_rows + k)
    rng = np.random.default_rng(k)
    xs = {
        "f": rng.normal(size=(n_rows, width, 2)).astype(np.float32),
        "i": rng.integers(-9, 9, (n_rows, width)).astype(np.int32),
        "b": rng.random((n_rows, width)) < 0.5,
    }
    outs = [[0] * k for _ in range(n_rows)]
    for sub in rows:
        for a, ra in enumerate(sub):
            for b, rb in enumerate(sub):
                outs[rb][a] = int(ins[ra][b])
    x = {key: dist.per_rank(list(v), g) for key, v in xs.items()}
    y = dist.all_to_all_single(x, outs, ins.tolist(), group=g)
    out_width = max(sum(o) for o in outs)
    for key, v in xs.items():
        want = [None] * n_rows
        for sub in rows:
            res = oracle.ragged_all_to_all([v[r] for r in sub], [ins[r] for r in sub], out_width)
            for i, r in enumerate(sub):
                want[r] = res[i][0]
        got = dist.to_ranks(y[key])
        for r in range(n_rows):
            np.testing.assert_array_equal(got[r], want[r], err_msg=f"{gname} {key} row {r}")


def test_new_tables_of_the_same_widths_reuse_the_program():
    x = dist.per_rank(lambda r: np.arange(8.0) + 10 * r)
    a = [[1] * 8 for _ in range(8)]
    b = [[0] * 8 for _ in range(8)]
    for r in range(8):
        b[r][(r + 1) % 8] = 8  # all 8 rows to the next rank: widths 8 in and out, as for a
    before = _ragged._a2a_program.cache_info().misses
    ya = dist.all_to_all_single(x, a, a)
    yb = dist.all_to_all_single(
        x, [[8 if j == (r - 1) % 8 else 0 for j in range(8)] for r in range(8)], b
    )
    assert _ragged._a2a_program.cache_info().misses - before <= 1
    assert _ragged._a2a_program(dist.world(), 8)._cache_size() == 1  # compiled once
    np.testing.assert_array_equal(dist.to_ranks(yb)[3], np.arange(8.0) + 20)
    np.testing.assert_array_equal(dist.to_ranks(ya)[3], np.arange(8.0) * 10 + 3)
    work = dist.all_to_all_single(x, a, a, async_op=True)
    np.testing.assert_array_equal(dist.to_ranks(work.wait())[3], np.arange(8.0) * 10 + 3)


def test_one_table_none_splits_that_side_evenly_as_torch():
    g = dist.new_group([0, 1, 2, 3])
    x = dist.per_rank(lambda r: np.arange(8, dtype=np.int32) + 10 * r, g)
    # input None: every rank sends 2 rows to each; output given must say so.
    y = dist.all_to_all_single(x, [[2] * 4] * 4, None, group=g)
    assert dist.to_ranks(y)[1].tolist() == [2, 3, 12, 13, 22, 23, 32, 33]
    # output None: each rank must receive equal parts from every rank.
    ins = [[1, 2, 3, 0]] * 4
    y = dist.all_to_all_single(x, None, ins, group=g)
    assert dist.to_ranks(y)[2].tolist() == [3, 4, 5, 13, 14, 15, 23, 24, 25, 33, 34, 35]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"output_split_sizes": [[1] * 4] * 4, "input_split_sizes": [[1] * 4] * 3},
            r"input_split_sizes must be a list of 4 lists \(one per rank",
        ),
        (
            {"output_split_sizes": [[1] * 4] * 4, "input_split_sizes": [[1, 1, 1]] * 4},
            r"input_split_sizes\[0\]=\[1, 1, 1\] must be a list of 4 ints",
        ),
        (
            {"output_split_sizes": [[1] * 4] * 4, "input_split_sizes": [[1, 1, 1, -1]] * 4},
            r"input_split_sizes\[0\]=\[1, 1, 1, -1\] has a negative size",
        ),
        (
            {"output_split_sizes": [[3] * 4] * 4, "input_split_sizes": [[3] * 4] * 4},
            r"input_split_sizes\[0\]=\[3, 3, 3, 3\] sums to 12, more than the width 8",
        ),
        (
            {"output_split_sizes": [[1] * 4] * 4, "input_split_sizes": [[1, 2, 1, 1]] * 4},
            r"input_split_sizes\[0\]\[1\]=2 but output_split_sizes\[1\]\[0\]=1: rank 0 sends "
            r"2 rows to rank 1, which expects 1",
        ),
        (
            {"input_split_sizes": [[1, 2, 3, 0]] * 3 + [[0, 2, 3, 1]]},
            r"output_split_sizes=None means rank 0 receives an equal part from every rank",
        ),
        (
            {"output_split_sizes": [[1] * 4] * 4, "input_split_sizes": [[1] * 4] * 4, "group": 3},
            r"group must be a Group",
        ),
        (
            {"output_split_sizes": [[1.5] * 4] * 4, "input_split_sizes": [[1] * 4] * 4},
            r"output_split_sizes\[0\] entry must be an int, got 1.5",
        ),
    ],
)
def test_all_to_all_single_errors(kwargs, match):
    g = dist.new_group([0, 1, 2, 3])
    kwargs.setdefault("group", g)
    x = dist.per_rank(lambda r: np.zeros(8, np.float32), g)
    with pytest.raises((ValueError, TypeError), match=match):
        dist.all_to_all_single(x, **kwargs)


def test_all_to_all_single_errors_on_shapes():
    g = dist.new_group([0, 1, 2])
    with pytest.raises(
        ValueError,
        match=r"x's rows have width 4, not divisible by the group "
        r"size 3. Pass input_split_sizes and output_split_",
    ):
        dist.all_to_all_single(dist.per_rank(lambda r: np.zeros(4), g), group=g)
    with pytest.raises(
        ValueError,
        match=r"input_split_sizes=None splits each rank's input "
        r"evenly, but x's rows have width 4",
    ):
        dist.all_to_all_single(dist.per_rank(lambda r: np.zeros(4), g), [[1] * 3] * 3, group=g)
    with pytest.raises(ValueError, match=r"one scalar per rank"):
        dist.all_to_all_single(dist.per_rank(lambda r: np.float32(r), g), group=g)


@pytest.mark.parametrize("gname", ["world", "size1", "size3", "local"])
def test_all_gather_and_gather_uneven_return_torchs_lists(gname):
    make, rows, devices = GROUPS[gname]
    g = make()
    n_rows, k = len(devices), g.size
    by_rank = [(2 * j + 1) % 4 for j in range(k)]  # 1, 3, 1, 3, ...: sizes per group rank
    sizes = [0] * n_rows
    for sub in rows:
        for j, r in enumerate(sub):
            sizes[r] = by_rank[j]
    rng = np.random.default_rng(n_rows + k)
    xs = rng.integers(0, 100, (n_rows, 4, 2)).astype(np.int32)
    x = dist.per_rank(list(xs), g)
    dst = k - 1
    gathered = dist.all_gather_uneven(x, sizes, group=g)
    rooted = dist.gather_uneven(x, sizes, group=g, group_dst=dst)
    assert len(gathered) == len(rooted) == k
    for j in range(k):
        assert gathered[j].shape == (n_rows, by_rank[j], 2)
        got, got_rooted = dist.to_ranks(gathered[j]), dist.to_ranks(rooted[j])
        for sub in rows:
            tensor_j = xs[sub[j]][: by_rank[j]]  # rank j's tensor in this subgroup
            for i, r in enumerate(sub):
                np.testing.assert_array_equal(got[r], tensor_j)
                np.testing.assert_array_equal(got_rooted[r], tensor_j if i == dst else 0 * tensor_j)


def test_uneven_gather_errors():
    x = dist.per_rank(lambda r: np.zeros((4, 2), np.float32))
    with pytest.raises(
        ValueError,
        match=r"dist.all_gather_uneven: sizes must be a list of 8 "
        r"ints, one per rank",
    ):
        dist.all_gather_uneven(x, [1, 2])
    with pytest.raises(ValueError, match=r"sizes\[2\]=5 is outside 0..4, the width of x's rows"):
        dist.all_gather_uneven(x, [1, 1, 5, 1, 1, 1, 1, 1])
    with pytest.raises(
        ValueError,
        match=r"the subgroups of .* would gather tensors of different "
        r"sizes \(\[1, 2\] and \[2, 1\] per group rank\)",
    ):
        dist.all_gather_uneven(x, [1, 2, 2, 1, 1, 2, 1, 2], group=dist.new_subgroups(2))
    with pytest.raises(ValueError, match=r"dist.gather_uneven: Global rank 3 is not part"):
        dist.gather_uneven(
            dist.per_rank(lambda r: np.zeros(4), dist.new_group([0, 1])),
            [1, 1],
            dst=3,
            group=dist.new_group([0, 1]),
        )
    work = dist.all_gather_uneven(x, [1] * 8, async_op=True)
    assert [a.shape for a in work.wait()] == [(8, 1, 2)] * 8


@pytest.mark.parametrize("gname", ["world", "size4"])
def test_reduce_scatter_uneven_is_torchs_reduce_scatter_v_test(gname):
    """PyTorch's test_reduce_scatter_v_cuda: the part of the rank of global rank ``src`` has
    ``src + 1`` rows; every rank's input is ``sum_len`` rows of 10 (torch's
    ``_build_tensor(sum_len, 10)``, shape (sum_len,) * 3) with its own part set to 2, so each
    rank's output is its part's rows, all 2 + 10 * (n - 1); async and not."""
    g = GROUPS[gname][0]()
    sizes = [src + 1 for src in g.ranks]
    starts, sum_len = np.cumsum([0, *sizes]), sum(sizes)

    def tensor(j):
        t = np.full((sum_len,) * 3, 10, np.float32)
        t[starts[j] : starts[j + 1]] = 2
        return t

    x = dist.per_rank(tensor, g)
    for async_op in (True, False):
        out = dist.reduce_scatter_uneven(x, sizes, dist.ReduceOp.SUM, g, async_op)
        rows = dist.to_ranks(out.wait() if async_op else out)
        for j, row in enumerate(rows):
            k = sizes[j]
            assert row.shape == (max(sizes), sum_len, sum_len)
            np.testing.assert_array_equal(
                row[:k], np.full((k, sum_len, sum_len), 2 + 10 * (g.size - 1))
            )
            assert not row[k:].any()  # padding


@pytest.mark.parametrize(
    "gname, op, sizes",
    [
        ("world", "sum", [2, 0, 1, 3, 1, 1, 2, 2]),
        ("size1", "max", [3]),
        ("size3", "product", [1, 3, 2]),
        ("ordered4", "avg", [0, 6, 1, 0]),  # one long part: the all_reduce lowering
        ("sub2", "bxor", [1, 2]),
        ("local", "min", [2, 1, 0, 2]),
    ],
)
def test_reduce_scatter_uneven_matches_numpy_on_groups(gname, op, sizes):
    make, rows, devices = GROUPS[gname]
    g = make()
    n_rows, width = len(devices), sum(sizes)
    rng = np.random.default_rng(n_rows + width)
    xs = {
        "f": rng.normal(size=(n_rows, width, 2)).astype(np.float32),
        "i": rng.integers(-9, 9, (n_rows, width)).astype(np.int32),
    }
    xs = {key: v for key, v in xs.items() if (op, key) not in (("avg", "i"), ("bxor", "f"))}
    x = {key: dist.per_rank(list(v), g) for key, v in xs.items()}
    y = dist.reduce_scatter_uneven(x, sizes, op, group=g)
    for key, v in xs.items():
        want = expected(
            rows, list(v), lambda m: [o for o, _ in oracle.reduce_scatter_uneven(m, op, sizes)]
        )
        got = dist.to_ranks(y[key])
        for r in range(n_rows):
            assert got[r].dtype == v.dtype and got[r].shape == (max(sizes), *v.shape[2:])
            np.testing.assert_allclose(
                got[r], want[r], rtol=1e-6, atol=1e-6, err_msg=f"{gname} {key} row {r}"
            )


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda x: dist.reduce_scatter_uneven(x, [1] * 7),
            ValueError,
            r"dist.reduce_scatter_uneven: sizes=\[1, 1, 1, 1, 1, 1, 1\] has 7 entries, but the "
            r"group has 8 ranks. Pass one size per rank",
        ),
        (
            lambda x: dist.reduce_scatter_uneven(x, [2, -1, 1, 1, 1, 1, 1, 0]),
            ValueError,
            r"dist.reduce_scatter_uneven: sizes\[1\]=-1 is negative",
        ),
        (
            lambda x: dist.reduce_scatter_uneven(x, [1] * 8),
            ValueError,
            r"dist.reduce_scatter_uneven: sizes=\[1, 1, 1, 1, 1, 1, 1, 1\] sums to 8, but x's rows "
            r"have width 6",
        ),
        (
            lambda x: dist.reduce_scatter_uneven(x, "12"),
            TypeError,
            r"dist.reduce_scatter_uneven: sizes must be a list of 8 static ints",
        ),
        (
            lambda x: dist.reduce_scatter_uneven(x, [6, 0], group=dist.new_subgroups(4)),
            ValueError,
            r"sizes=\[6, 0\] has 2 entries, but the group has 4 ranks",
        ),
        (
            lambda x: dist.reduce_scatter_uneven(x.astype(np.int32), [6] + [0] * 7, "avg"),
            TypeError,
            r"dist.reduce_scatter_uneven: op=ReduceOp.AVG is not defined for dtype int32",
        ),
        (
            lambda x: dist.reduce_scatter_uneven(x, [6] + [0] * 7, "mode"),
            ValueError,
            r"dist.reduce_scatter_uneven: op='mode' is not a reduce op",
        ),
        (
            lambda x: dist.reduce_scatter_uneven(x[:, 0, 0], [0] * 8),
            ValueError,
            r"dist.reduce_scatter_uneven: x has shape \(8,\), one scalar per rank",
        ),
        (
            lambda x: dist.reduce_scatter_uneven(x, [6] + [0] * 7, group=[0, 1]),
            TypeError,
            r"dist.reduce_scatter_uneven: group must be a Group",
        ),
    ],
)
def test_reduce_scatter_uneven_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(dist.per_rank(lambda r: np.zeros((6, 2), np.float32)))


@pytest.mark.parametrize("gname", ["world", "size3", "sub2", "ordered4"])
def test_scan_and_exscan_on_groups(gname):
    """The dist plumbing (group rank order, partitions, pytrees); every op, dtype and group
    size of the primitive is in tests/primitives/test_scan.py."""
    make, rows, devices = GROUPS[gname]
    g = make()
    n_rows = len(devices)
    rng = np.random.default_rng(n_rows)
    xs = {
        "f": rng.normal(size=(n_rows, 3)).astype(np.float32),
        "i": rng.integers(0, 16, (n_rows, 3)).astype(np.int32),
        "b": rng.random((n_rows, 3)) < 0.3,
    }
    x = {key: dist.per_rank(list(v), g) for key, v in xs.items()}
    for fn, op in ((dist.scan, "sum"), (dist.exscan, dist.ReduceOp.MAX)):
        y = fn(x, op, group=g)
        ref = getattr(oracle, fn.__name__)
        for key, v in xs.items():
            want = expected(
                rows, list(v), lambda m, ref=ref, op=op: ref(m, getattr(op, "value", op))
            )
            got = dist.to_ranks(y[key])
            for r in range(n_rows):
                np.testing.assert_allclose(
                    got[r],
                    np.asarray(want[r]).astype(got[r].dtype),
                    rtol=1e-6,
                    err_msg=f"{fn.__name__} {key} {r}",
                )
    with pytest.raises(
        TypeError,
        match=r"dist.exscan: op=ReduceOp.BXOR is not defined for "
        r"dtype float32",
    ):
        dist.exscan(x["f"], "bxor", group=g)
    assert isinstance(dist.scan(x["i"], group=g, async_op=True), dist.Work)
