"""What docs/porting.md says about reading params on the host is what jaxcoll does: the page
points to ``Trainer.host_params`` and ``Trainer.to_module`` (tests/multihost/test_checkpoint.py
runs both after an FSDP run over 2 processes) and says neither fails; test_docs.py runs its
code."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _section(title: str) -> str:
    with open(os.path.join(ROOT, "docs", "porting.md")) as fh:
        text = fh.read()
    start = text.index(f"### {title}\n")
    end = text.find("\n#", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_porting_page_reads_params_with_host_params_and_to_module():
    # Before: the page said to_module raises under multi-process FSDP and never named
    # host_params, which gathers the split params on every process.
    page = _section("Parameters on the host")
    assert "host = trainer.host_params(state)" in page  # in the code the page runs
    assert "`trainer.to_module(state)` reads the params the same way" in page
    assert not re.search(r"So does\s+`trainer\.to_module", page)
    assert "tests/multihost/test_checkpoint.py" in page
    with open(os.path.join(ROOT, "tests", "multihost", "workers", "ckpt.py")) as fh:
        worker = fh.read()  # the multi-process run the page cites calls both
    assert "trainer.host_params(state)" in worker and "trainer.to_module(state)" in worker
