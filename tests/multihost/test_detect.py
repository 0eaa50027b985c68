"""Mismatch detection (``JAXCOLL_DEBUG=detail``) of the user's own ``jaxcoll.watch``-ed
programs: two processes whose watched programs differ only in what they compute (the same
name and shapes, another lowered program) both raise naming each one's program hash, before
either runs (tests/multihost/workers/watched.py). ``jaxcoll.distributed``'s own detection is
tested in test_hangs.py."""

from __future__ import annotations

import re

import pytest

from ._launch import launch, survivors

DETAIL = [
    *("--nprocs", "2", "--devices-per-proc", "2", "--grace", "3"),
    *("--timeout", "10", "--first-timeout", "10", "--debug", "detail"),
]


@pytest.mark.timeout(90)
def test_watched_programs_that_differ_between_processes_raise_on_both(tmp_path):
    job = launch(DETAIL, "watched.py", [], timeout=90)
    assert job.returncode == 1, job.stderr[-3000:]
    hashes = []
    for k in (0, 1):
        m = re.search(
            rf"^\[{k}\] RuntimeError: user step: processes disagree on the collective #1: "
            r"process 0: user step float32\[4,3\] program=([0-9a-f]{12}); "
            r"process 1: user step float32\[4,3\] program=([0-9a-f]{12})$",
            job.stderr,
            re.M,
        )
        assert m, job.stderr[-3000:]
        hashes.append(m.groups())
    assert hashes[0] == hashes[1] and hashes[0][0] != hashes[0][1], hashes
    assert "result" not in job.stdout  # neither program ran
    assert "jaxcoll-run: failed: process" in job.stderr
    assert survivors(job.token) == []
