"""Run the Python code blocks of a Markdown page as a reader would, and check what they print.

The conventions, the README's quick example's extended to every page:

* Every ```` ```python ```` block is run. The blocks of a page run in order in one Python
  process and share their names, as a reader runs them one after the other, with 8 simulated
  CPU devices (``jaxcoll.xla_cpu_flags(devices=8)``) in a fresh temporary directory.
* A block that sets ``os.environ["XLA_FLAGS"]`` picks its own devices, so it starts a new
  process (the quick example's 4 devices). The driver itself imports neither JAX nor jaxcoll.
* A block followed by a line ``Output:``, a blank line and a ```` ``` ```` block must print
  exactly that (surrounding blank lines aside).
* A block right after a line ``<!-- not run: REASON -->`` is not run (it needs several
  processes, say). When REASON names a file of this repository (``examples/x.py``,
  ``tests/.../y.py``), every line of the block must appear in that file, which is run by a
  test, so the page cannot drift from code that runs.
* Other blocks (```` ```bash ````, plain ```` ``` ````) are commands or output: not run.

Run as a script, this file is the driver of one process: it executes the blocks given in a
JSON file and writes what each printed, or the error that stopped it, to another.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
OUTPUT = re.compile(r"\s*\nOutput:\n\n```\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->")
SETS_DEVICES = re.compile(r"os\.environ\[[\"']XLA_FLAGS[\"']\]\s*=")
FILE = re.compile(r"\b((?:examples|tests|benchmarks|jaxcoll)/[\w/.-]+\.py)\b")


@dataclass
class Block:
    """One ```` ```python ```` block of a page."""

    where: str  # "page.md:LINE", LINE the block's first code line
    code: str
    output: str | None  # what it must print, when an Output: block follows it
    not_run: str | None  # the reason given by a <!-- not run: ... --> line above it


def blocks(path: Path) -> list[Block]:
    """The page's Python blocks, in order."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        line = text.count("\n", 0, m.start()) + 2
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        skip = NOT_RUN.fullmatch(before)
        shown = OUTPUT.match(text, m.end())
        found.append(
            Block(
                f"{path.name}:{line}",
                m.group(2),
                shown.group(1) if shown else None,
                skip.group(1) if skip else None,
            )
        )
    return found


def sessions(page: list[Block]) -> list[list[Block]]:
    """The page's runnable blocks, split into processes: a new one at each block that sets
    ``XLA_FLAGS`` itself."""
    out: list[list[Block]] = []
    for block in page:
        if block.not_run is not None:
            continue
        if not out or SETS_DEVICES.search(block.code):
            out.append([])
        out[-1].append(block)
    return out


def check_not_run(block: Block) -> None:
    """A block that is not run names why; if the reason names a file, the block is in it."""
    assert block.not_run.strip(), f"{block.where}: say why the block is not run"
    named = FILE.findall(block.not_run)
    for name in named:
        source = (ROOT / name).read_text()
        missing = [
            ln.strip() for ln in block.code.splitlines() if ln.strip() and ln.strip() not in source
        ]
        assert not missing, f"{block.where}: lines not in {name}: {missing}"


def run(
    session: list[Block], cwd: Path, xla_flags: str, prelude: str = "", timeout: int = 300
) -> list[str]:
    """Run one session's blocks in a new process with ``XLA_FLAGS=xla_flags`` (a block may
    set its own) and ``prelude`` run first; return what each block printed."""
    spec = cwd / "blocks.json"
    result = cwd / "result.json"
    spec.write_text(
        json.dumps({"prelude": prelude, "blocks": [(b.where, b.code) for b in session]})
    )
    env = dict(os.environ, XLA_FLAGS=xla_flags)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, __file__, str(spec), str(result)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(result.read_text())
    assert done["error"] is None, done["error"]
    return done["printed"]


def check_printed(session: list[Block], printed: list[str]) -> None:
    """Each block with an ``Output:`` block printed exactly that."""
    for block, out in zip(session, printed, strict=True):
        if block.output is not None:
            assert out.strip() == block.output.strip(), (
                f"{block.where} printed:\n{out}\nthe page shows:\n{block.output}"
            )


def _drive(spec_path: str, result_path: str) -> None:
    # The blocks see the path a reader's script would, without this file's folder (tests/).
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    spec = json.loads(Path(spec_path).read_text())
    namespace: dict = {"__name__": "__main__"}
    printed: list[str] = []
    error = None
    where = "<stand-ins>"
    try:
        if spec["prelude"]:
            exec(compile(spec["prelude"], "<stand-ins>", "exec"), namespace)
        for where, code in spec["blocks"]:
            page, line = where.rsplit(":", 1)
            # Line numbers in tracebacks are the page's: pad the code down to its first line.
            source = "\n" * (int(line) - 1) + code
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                try:
                    exec(compile(source, page, "exec"), namespace)
                finally:
                    printed.append(buffer.getvalue())
    except BaseException:
        error = f"the block at {where} failed:\n" + traceback.format_exc()[-3000:]
    Path(result_path).write_text(json.dumps({"printed": printed, "error": error}))


if __name__ == "__main__":
    _drive(sys.argv[1], sys.argv[2])
