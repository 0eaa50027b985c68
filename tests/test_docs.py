"""The documentation site: its code runs, its reference covers the API, and it builds strictly.

* Every page's Python code runs and prints what the page shows (the conventions are in
  tests/snippets.py).
* Every name in a public ``__all__`` (any module or package of jaxcoll with no ``_`` in its
  path) has a ``::: path`` entry on a page of docs/reference/ that resolves to that object.
* ``mkdocs build --strict`` succeeds with no warning (``make docs`` runs the same build).
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jaxcoll
from jaxcoll import xla_cpu_flags

from . import snippets
from .compile_flags import with_fast_compile

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
PAGES = sorted(DOCS.glob("*.md"))
XLA_FLAGS = with_fast_compile(" ".join(xla_cpu_flags(devices=8)))

# docs/dp.md is the README's data-parallel section moved as it stands; its snippets name a
# model, data and arrays they do not define, as a reader's script would have them. These are
# small stand-ins under those names (an MLP for `model` and `ResNet`, an nnx MLP with
# BatchNorm and Dropout for `CNN`, 192 + 64 random examples), run before the page's blocks.
STANDINS = {
    "dp.md": """
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

from jaxcoll import dp


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


class ResNet(nn.Module):  # called as flax's ResNet is: module(x, train=...), BatchNorm state
    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(16, use_bias=False)(x)
        x = dp.SyncBatchNorm(use_running_average=not train)(x)
        return nn.Dense(4)(nn.relu(x))


class CNN(nnx.Module):  # called as flax's nnx CNN is: model(x, rngs=rngs)
    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x, rngs=None):
        x = nnx.relu(self.norm(self.hidden(x)))
        return self.out(self.dropout(x, rngs=rngs))


_rng = np.random.default_rng(0)
_x = _rng.standard_normal((256, 8)).astype(np.float32)
_y = ((_x[:, 0] > 0).astype(np.int32) + 2 * (_x[:, 1] > 0)).astype(np.int32)
train_arrays = {"x": _x[:192], "image": _x[:192], "y": _y[:192]}
test_arrays = {"x": _x[192:], "image": _x[192:], "y": _y[192:]}
test = dp.Batches(test_arrays, 64, shuffle=False)
images = _x[192:200]
model = MLP()
params = model.init(jax.random.key(0), _x[:1])["params"]
global_batch = {"x": _x[:64], "y": _y[:64]}
""",
}


def _runnable(page: Path) -> bool:
    return any(b.not_run is None for b in snippets.blocks(page))


@pytest.mark.parametrize("page", [p.name for p in PAGES if _runnable(p)])
def test_page_code_runs_and_prints_what_the_page_shows(page, tmp_path):
    blocks = snippets.blocks(DOCS / page)
    for i, session in enumerate(snippets.sessions(blocks)):
        cwd = tmp_path / f"session{i}"
        cwd.mkdir()
        printed = snippets.run(session, cwd, XLA_FLAGS, STANDINS.get(page, "") if i == 0 else "")
        snippets.check_printed(session, printed)


def test_blocks_not_run_say_why_and_match_the_file_they_name():
    for page in [*PAGES, ROOT / "README.md"]:
        for block in snippets.blocks(page):
            if block.not_run is not None:
                snippets.check_not_run(block)


def test_snippet_conventions(tmp_path):
    """The parser behind the tests above: outputs, blocks not run, a new process per device
    setting."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(1)\n```\n\nOutput:\n\n```\n1\n```\n\n"
        "<!-- not run: needs 2 processes (tests/snippets.py) -->\n"
        "```python\nimport json\n```\n\n"
        "```bash\nmake docs\n```\n\n"
        '```python\nimport os\nos.environ["XLA_FLAGS"] = "--x"\n```\n'
        "```python\nprint(2)\n```\n"
    )
    blocks = snippets.blocks(page)
    assert [b.where for b in blocks] == ["page.md:2", "page.md:13", "page.md:21", "page.md:25"]
    assert [b.output for b in blocks] == ["1\n", None, None, None]
    assert blocks[1].not_run == "needs 2 processes (tests/snippets.py)"
    snippets.check_not_run(blocks[1])  # "import json" is a line of tests/snippets.py
    blocks[1].code = "import not_a_line_of_that_file\n"
    with pytest.raises(AssertionError, match="lines not in tests/snippets.py"):
        snippets.check_not_run(blocks[1])
    assert [[b.where for b in s] for s in snippets.sessions(blocks)] == [
        ["page.md:2"],
        ["page.md:21", "page.md:25"],
    ]
    with pytest.raises(AssertionError, match="page.md:2 printed"):
        snippets.check_printed(blocks[:1], ["2\n"])


# ------------------------------------------------------------------------- the API reference
def public_modules() -> list[str]:
    """Every module of jaxcoll with no ``_`` path component that assigns ``__all__``, found
    from the source (nothing is imported to look)."""
    found = []
    package = Path(jaxcoll.__file__).parent
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts):
            continue
        tree = ast.parse(path.read_text())
        if any(
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for node in tree.body
        ):
            found.append(".".join(parts))
    return found


def resolve(path: str):
    """The object a ``::: path`` entry names (its longest importable module prefix, then
    attributes)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def reference_entries(folder: Path = REFERENCE) -> dict[str, str]:
    """``{identifier: page}`` for every ``::: identifier`` line of the reference pages."""
    entries = {}
    for page in sorted(folder.glob("*.md")):
        for ident in re.findall(r"^::: *([\w.]+) *$", page.read_text(), re.M):
            entries[ident] = page.name
    return entries


def undocumented(entries: dict[str, str]) -> list[str]:
    """Names of public ``__all__`` lists whose object no entry resolves to."""
    documented = {id(resolve(ident)) for ident in entries}
    return [
        f"{module}.{name}"
        for module in public_modules()
        for name in importlib.import_module(module).__all__
        if id(getattr(importlib.import_module(module), name)) not in documented
    ]


def test_the_public_modules_are_found():
    modules = public_modules()
    for expected in (
        "jaxcoll",
        "jaxcoll.primitives",
        "jaxcoll.distributed",
        "jaxcoll.algorithms",
        "jaxcoll.groups",
        "jaxcoll.dp",
        "jaxcoll.dp.sync",
        "jaxcoll.dp.hooks",
        "jaxcoll.parallel",
        "jaxcoll.nn",
        "jaxcoll.run",
        "jaxcoll.bench",
    ):
        assert expected in modules
    assert not [m for m in modules if "._" in m]


def test_every_public_name_is_in_the_api_reference():
    entries = reference_entries()
    assert len(entries) > 100
    missing = undocumented(entries)
    assert not missing, (
        f"no ::: entry in docs/reference/ for {missing}: add one to the module's page"
    )


def test_a_name_missing_from_the_reference_is_reported(tmp_path):
    for page in REFERENCE.glob("*.md"):
        text = page.read_text()
        if page.name == "primitives.md":
            assert "\n::: jaxcoll.primitives.scan\n" in text
            text = text.replace("\n::: jaxcoll.primitives.scan\n", "\n")
        (tmp_path / page.name).write_text(text)
    assert undocumented(reference_entries(tmp_path)) == ["jaxcoll.primitives.scan"]


def test_every_reference_entry_resolves():
    for ident, page in reference_entries().items():
        assert resolve(ident) is not None, f"{page}: ::: {ident}"


# ------------------------------------------------------------------------------- the build
def test_site_builds_strictly_without_warnings(tmp_path):
    # mkdocs comes with the docs extra, which `make` installs (pip install -e ".[docs]").
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "primitives" / "index.html").is_file()
