"""Real multi-process runs on 127.0.0.1 through ``python -m jaxcoll.run``.

One launch as 1 process x 8 devices and one as 2 processes x 4 devices run every primitive and
every ``dist`` op (tests/multihost/workers/collectives.py); the results must agree with each
other and with NumPy. ``init`` itself is tested in-process where no job is needed.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jaxcoll

from ._launch import launch, load_rows, survivors

N = 8


def _layout(tmp_root: str, nprocs: int):
    out = f"{tmp_root}/{nprocs}x{N // nprocs}"
    job = launch(
        ["--nprocs", str(nprocs), "--devices-per-proc", str(N // nprocs)],
        "collectives.py",
        [out],
        timeout=240,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert survivors(job.token) == []
    return job, load_rows(out)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layouts"))
    return _layout(root, 1), _layout(root, 2)


def _inputs():
    rng = np.random.default_rng(0)  # the worker's inputs, drawn in the same order
    return {
        "f": rng.standard_normal((N, 8, 3)).astype(np.float32),
        "i": rng.integers(0, 16, (N, 8)).astype(np.int32),
        "b": rng.random((N, 4)) > 0.5,
        "t": rng.standard_normal((N, 24, 2)).astype(np.float32),
    }


def _stack(rows: dict[int, np.ndarray]) -> np.ndarray:
    assert sorted(rows) == list(range(len(rows)))
    return np.stack([rows[r] for r in range(len(rows))])


@pytest.mark.timeout(300)
def test_every_op_same_on_1x8_and_2x4(layouts):
    (_, one), (job, two) = layouts
    computed = sorted(k for k in one if not k.startswith("proc/"))
    assert len(computed) > 150  # 4 axes x 24 primitives + 7 groups x 12 dist ops
    assert sorted(k for k in two if not k.startswith("proc/")) == computed
    for name in computed:
        assert sorted(one[name]) == sorted(two[name]), name
        a, b = _stack(one[name]), _stack(two[name])
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.dtype.kind in "fc":
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(b, a, err_msg=name)
    # Both processes ran and their output lines carry the process index.
    assert "[0] process 0: saved" in job.stdout and "[1] process 1: saved" in job.stdout


@pytest.mark.timeout(300)
def test_2x4_results_match_numpy(layouts):
    _, (_, res) = layouts
    x = _inputs()
    f, i = x["f"], x["i"]
    got = {k: _stack(v) for k, v in res.items() if not k.startswith("proc/")}
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
    # One group of all 8 ranks, spanning both processes.
    for key in ("1d/x", "2d/('node', 'local')"):
        close(got[f"{key}/ar_sum"], np.broadcast_to(f.sum(0), f.shape))
        close(got[f"{key}/ar_max"], np.broadcast_to(f.max(0), f.shape))
        np.testing.assert_array_equal(
            got[f"{key}/ar_bxor"], np.broadcast_to(np.bitwise_xor.reduce(i, 0), i.shape)
        )
        np.testing.assert_array_equal(got[f"{key}/all_gather"], np.broadcast_to(f, (N, *f.shape)))
        np.testing.assert_array_equal(got[f"{key}/bcast"], np.broadcast_to(f[7], f.shape))
        np.testing.assert_array_equal(got[f"{key}/shift"], np.roll(i, 1, axis=0))
        close(got[f"{key}/reduce_scatter"], f.sum(0)[:, None])
        np.testing.assert_array_equal(got[f"{key}/all_to_all"], f.transpose(1, 0, 2))
    # "node" pairs rank r with r +- 4 (the other process); "local" is the 4 ranks of a process.
    pairs = f.reshape(2, 4, 8, 3).sum(0)
    close(got["2d/node/ar_sum"], np.concatenate([pairs, pairs]))
    blocks = f.reshape(2, 4, 8, 3).sum(1)
    close(got["2d/local/ar_sum"], np.repeat(blocks, 4, axis=0))
    np.testing.assert_array_equal(got["2d/local/rank"], np.tile(np.arange(4), 2))
    # dist: a group spanning processes, and one inside process 1.
    close(got["dist/span/all_reduce"], np.broadcast_to(f[[1, 5, 6]].sum(0), (3, 8, 3)))
    # new_group([6, 4]) orders its ranks as torch does: group rank 1 is global rank 6
    np.testing.assert_array_equal(got["dist/inside/broadcast"], np.stack([f[6], f[6]]))
    np.testing.assert_array_equal(
        got["dist/sub4/all_reduce_max"], np.repeat(i.reshape(2, 4, 8).max(1), 4, axis=0)
    )


@pytest.mark.timeout(300)
def test_process_level_helpers_across_processes(layouts):
    _, (_, res) = layouts
    assert sorted(res["proc/process_count"]) == [0, 1]
    for p in (0, 1):
        assert int(res["proc/process_count"][p]) == 2
        np.testing.assert_array_equal(res["proc/world_ranks"][p], np.arange(8))
        # broadcast_object from process 1, all_gather_object in process order
        assert int(res["proc/broadcast_object"][p]) == 1
        np.testing.assert_array_equal(res["proc/all_gather_object"][p], [0, 1])
        # to_ranks / local_ranks: only the rows of this process's devices
        np.testing.assert_array_equal(res["proc/local_ranks_world"][p], np.arange(4 * p, 4 * p + 4))
        # torch's object collectives, process 1 the source / destination where it can be
        np.testing.assert_array_equal(res["proc/broadcast_object_list"][p], [1, 50])
        assert int(res["proc/scatter_object_list"][p]) == 10 + p
    np.testing.assert_array_equal(res["proc/gather_object"][1], [0, 1])
    assert 0 not in res["proc/gather_object"]  # only dst fills its list
    # send/recv: 1 got process 0's two lists in order; 0 got the answer back
    np.testing.assert_array_equal(res["proc/recv_object_list"][1], [0, 1, 2])
    np.testing.assert_array_equal(res["proc/recv_object_list"][0], [1, 1])
    # the in-process group's rows exist only in process 1's file
    assert sorted(res["dist/inside/all_reduce"]) == [0, 1]


def test_init_is_a_noop_for_one_process(monkeypatch):
    for var in (
        "JAXCOLL_COORDINATOR_ADDRESS",
        "JAXCOLL_NUM_PROCESSES",
        "JAXCOLL_PROCESS_ID",
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
    ):
        monkeypatch.delenv(var, raising=False)
    first = jaxcoll.init()
    again = jaxcoll.init(num_processes=1, process_id=0, coordinator_address="127.0.0.1:1")
    assert first.ranks == again.ranks == tuple(range(N))
    assert not jaxcoll.distributed.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "env", "error", "match"),
    [
        (
            {"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 2},
            {},
            ValueError,
            r"init: process_id=2 \(from the arguments\) is out of range for a job of 2",
        ),
        (
            {"coordinator_address": "nohost", "num_processes": 2, "process_id": 0},
            {},
            ValueError,
            r"coordinator_address='nohost' .* is not 'host:port'",
        ),
        ({"num_processes": 2.0, "process_id": 0}, {}, TypeError, "num_processes must be an int"),
        (
            {},
            {"JAXCOLL_COORDINATOR_ADDRESS": "127.0.0.1:5"},
            ValueError,
            "JAXCOLL_COORDINATOR_ADDRESS is set but JAXCOLL_NUM_PROCESSES, JAXCOLL_PROCESS_ID",
        ),
        (
            {},
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
            ValueError,
            "JAX_NUM_PROCESSES='two' is not an integer",
        ),
        (
            {},
            {"MASTER_ADDR": "h", "MASTER_PORT": "9", "WORLD_SIZE": "4", "RANK": "7"},
            ValueError,
            r"process_id=7 \(from torchrun environment variables\) is out of range",
        ),
        ({"initialization_timeout": 0}, {}, ValueError, "initialization_timeout=0 must be"),
    ],
)
def test_init_rejects_bad_job_descriptions(monkeypatch, kwargs, env, error, match):
    for var in (
        "JAXCOLL_COORDINATOR_ADDRESS",
        "JAXCOLL_NUM_PROCESSES",
        "JAXCOLL_PROCESS_ID",
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(error, match=match):
        jaxcoll.init(**kwargs)


def test_init_after_jax_started_says_to_call_it_first():
    import jax

    jax.devices()  # the backend is up in the test process
    with pytest.raises(RuntimeError, match="Call jaxcoll.init\\(\\) first"):
        jaxcoll.init("127.0.0.1:29999", 2, 0)
