"""The README's code runs and prints exactly the output the README shows, and its links lead
somewhere.

The conventions (a block followed by ``Output:`` must print it, ...) are tests/snippets.py's;
tests/test_docs.py runs the pages of docs/ the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

from jaxcoll import xla_cpu_flags

from . import snippets

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_example_output_matches_readme(tmp_path):
    blocks = snippets.blocks(README)
    quick = [b for b in blocks if b.output is not None]
    assert quick and "xla_force_host_platform_device_count=4" in quick[0].code
    for i, session in enumerate(snippets.sessions(blocks)):
        cwd = tmp_path / f"session{i}"
        cwd.mkdir()
        printed = snippets.run(session, cwd, " ".join(xla_cpu_flags(devices=8)))
        snippets.check_printed(session, printed)


def test_readme_links_point_to_files_that_exist():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    assert any(t.startswith("docs/") for t in targets)
    missing = [t for t in targets if "://" not in t and not (README.parent / t).exists()]
    assert not missing, missing
