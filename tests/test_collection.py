"""Every test folder is collected by a plain `pytest` run (pytest skips some names by default)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_folder_is_collected():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", str(TESTS)],
                          capture_output=True, text=True, timeout=300, cwd=TESTS.parent)
    collected = {line.split("::")[0].split("/")[1] for line in proc.stdout.splitlines()
                 if line.startswith("tests/") and "::" in line and line.count("/") >= 2}
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert folders, "no test folders found"
    assert folders <= collected, f"never collected: {sorted(folders - collected)}"
