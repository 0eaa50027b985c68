"""Importing jaxcoll has no side effects: no device query, no environment change, no flax."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

PROBE = """
import os, sys
before = dict(os.environ)
import jaxcoll
from jaxcoll._jax import backends_are_initialized
assert not backends_are_initialized(), "importing jaxcoll initialized a JAX backend"
assert dict(os.environ) == before, "importing jaxcoll changed the environment"
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'optax', 'orbax'))
assert not heavy, heavy
print(sorted(jaxcoll.__all__))
"""


def test_import_has_no_side_effects():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'primitives'" in proc.stdout and "'distributed'" in proc.stdout


def test_dist_is_distributed_under_its_short_name():
    import jaxcoll
    from jaxcoll import dist, distributed

    assert dist is distributed is jaxcoll.dist is jaxcoll.distributed
    assert importlib.import_module("jaxcoll.dist") is distributed  # `import jaxcoll.dist`
    assert dist.all_reduce is distributed.all_reduce
    assert not [m for m in sys.modules if m.startswith("jaxcoll.dist.")]  # nothing loaded twice


def test_no_module_is_shadowed_by_what_its_package_exports():
    """``import jaxcoll.x.y as m`` gives the module ``y``, never a function named ``y``: modules
    that define a public function of the same name are private (``primitives/_all_reduce.py``)."""
    import jaxcoll

    shadowed = []
    for info in pkgutil.walk_packages(jaxcoll.__path__, "jaxcoll."):
        if info.name.endswith(".__main__"):  # running it is the point of importing it
            continue
        module = importlib.import_module(info.name)
        parent, _, leaf = info.name.rpartition(".")
        if getattr(importlib.import_module(parent), leaf) is not module:
            shadowed.append(info.name)
    assert "jaxcoll.primitives._all_reduce" in sys.modules  # the walk reached the primitives
    assert shadowed == []


def test_no_file_keeps_a_merge_conflict():
    # A conflicted merge committed as it stood once hid a row of docs/architecture.md.
    root = Path(__file__).resolve().parent.parent
    files = subprocess.run(
        ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    marker = re.compile(r"^(<<<<<<< |>>>>>>> |=======$)", re.M)
    conflicted = []
    for name in files:
        path = root / name
        if path.suffix in {".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".sh", ".sbatch"}:
            if marker.search(path.read_text(errors="replace")):
                conflicted.append(name)
    assert conflicted == []
