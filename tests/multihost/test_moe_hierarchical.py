"""parallel.moe_mlp's hierarchical exchange across 2 real processes x 4 devices (gloo): the
node axis spans the processes, the outputs and gradients equal the flat all-to-all's (and the
output a NumPy oracle's), and the compiled hierarchical step brings each device fewer bytes
from the other process (tests/multihost/workers/moe_hierarchical.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ..parallel.test_moe_hierarchical import oracle
from ._launch import launch, survivors


@pytest.mark.timeout(300)
def test_hierarchical_equals_flat_across_processes_with_fewer_bytes(tmp_path):
    out = tmp_path / "moe"
    job = launch(
        ["--nprocs", "2", "--devices-per-proc", "4"],
        "moe_hierarchical.py",
        [str(out)],
        timeout=240,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    assert survivors(job.token) == []
    res = dict(np.load(out / "result.npz"))
    args = [res[f"inputs/{i}"] for i in range(4)]
    want = oracle(*args, factor=None, groups=None, limit=None)
    np.testing.assert_allclose(res["hier/y"], want, atol=1e-5, rtol=1e-5)
    for key in ("y", "g0", "g1", "g2", "g3"):
        assert res[f"hier/{key}"].shape == res[f"flat/{key}"].shape, key
        np.testing.assert_allclose(res[f"hier/{key}"], res[f"flat/{key}"], atol=1e-6, rtol=1e-5)
    assert 0 < res["hier/cross"] < res["flat/cross"] / 4
