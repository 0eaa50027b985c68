"""Every test folder is collected by a plain `pytest` run.

pytest skips folders matching ``norecursedirs`` (``build``, ``dist``, ``venv`` and others by
default), so a test folder given such a name would never run, and nothing would say so.

Except ``tests/slurm``, on purpose: its jobs need root and a SLURM cluster, which
``make test-slurm`` sets up; ``make test`` must run without either.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
NOT_COLLECTED = {"slurm"}  # make test-slurm


def test_every_test_folder_is_collected():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            str(TESTS),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TESTS.parent,
    )
    collected = {
        line.split("::")[0].split("/")[1]
        for line in proc.stdout.splitlines()
        if line.startswith("tests/") and "::" in line and line.count("/") >= 2
    }
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")} - NOT_COLLECTED
    assert folders, "no test folders found"
    assert folders <= collected, f"never collected: {sorted(folders - collected)}"
    assert not collected & NOT_COLLECTED, f"collected: {sorted(collected & NOT_COLLECTED)}"


def test_slurm_jobs_are_left_to_make_test_slurm(pytestconfig):
    assert (TESTS / "slurm" / "run.sh").is_file()
    assert NOT_COLLECTED <= set(pytestconfig.getini("norecursedirs"))
