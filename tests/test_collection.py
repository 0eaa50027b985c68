"""Every test folder is collected by a plain `pytest` run, and the slow tier names tests.

pytest skips folders matching ``norecursedirs`` (``build``, ``dist``, ``venv`` and others by
default), so a test folder given such a name would never run, and nothing would say so.

Except ``tests/slurm``, on purpose: its jobs need root and a SLURM cluster, which
``make test-slurm`` sets up; ``make test`` must run without either.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

from tests import slow

TESTS = Path(__file__).resolve().parent
NOT_COLLECTED = {"slurm"}  # make test-slurm


@functools.cache
def _collected() -> list[str]:
    """The node ids a plain ``pytest --collect-only`` of tests/ collects."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + [str(TESTS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TESTS.parent,
    )
    return [line for line in proc.stdout.splitlines() if line.startswith("tests/") and "::" in line]


def test_every_test_folder_is_collected():
    collected = {line.split("::")[0].split("/")[1] for line in _collected() if line.count("/") >= 2}
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")} - NOT_COLLECTED
    assert folders, "no test folders found"
    assert folders <= collected, f"never collected: {sorted(folders - collected)}"
    assert not collected & NOT_COLLECTED, f"collected: {sorted(collected & NOT_COLLECTED)}"


def test_slurm_jobs_are_left_to_make_test_slurm(pytestconfig):
    assert (TESTS / "slurm" / "run.sh").is_file()
    assert NOT_COLLECTED <= set(pytestconfig.getini("norecursedirs"))


def test_every_slow_entry_names_a_test_and_every_file_stays_in_make_test(request):
    everything = _collected()
    for path, entries in slow.SLOW.items():
        names = [n.split("::", 1)[1] for n in everything if n.startswith(f"tests/{path}::")]
        for entry in entries:
            assert any(slow.matches(entry, name) for name in names), f"{path}: {entry}"
    fast = {n.split("::")[0] for n in everything if not slow.is_slow(n)}
    whole = {f"tests/{path}" for path in slow.WHOLE}
    assert fast == {n.split("::")[0] for n in everything} - whole
    # conftest marks exactly the tier (make test deselects by the mark)
    for item in request.session.items:
        assert (item.get_closest_marker("slow") is not None) == slow.is_slow(item.nodeid)
