"""The package's imports point down its layers, and never in a circle.

Layers, lowest first (docs/architecture.md): the shared modules ``jaxcoll._jax`` (the one
door to JAX internals), ``jaxcoll._xla_flags`` (XLA:CPU's settings) and ``jaxcoll.trace``
(the flight records' analysis), which import nothing of jaxcoll, < ``jaxcoll._core``
(ground) < ``algorithms`` < ``primitives`` < ``groups`` < ``distributed``, ``dp``,
``parallel`` < ``bench``, ``nn`` < the top-level re-exports (``nn``, the flax layers on
``parallel``, imports nothing of ``dp``). ``_init`` (joining a
multi-process job), ``_watch`` (watchdog, mismatch detection, SIGTERM) and ``run`` (the
launcher) stand apart and import nothing of jaxcoll outside themselves but the shared modules.
A module may import modules of a lower layer and of its own package; every import counts, at
module level or inside a function (a function-local import that dodges a circle is still a
circle, so none are allowed).

JAX internals (``jax._src``, ``jax.interpreters``, ``jax.extend``) are reached through
``jaxcoll._jax`` alone, so a JAX release that moves one breaks one file.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxcoll"

# (unit, layer): a module belongs to the longest unit that prefixes its name.
UNITS = {
    "jaxcoll._jax": -1,
    "jaxcoll._core": 0,
    "jaxcoll._init": 0,
    "jaxcoll._watch": 0,
    "jaxcoll._xla_flags": -1,
    "jaxcoll.trace": -1,
    "jaxcoll.run": 0,
    "jaxcoll.algorithms": 1,
    "jaxcoll.primitives": 2,
    "jaxcoll.groups": 3,
    "jaxcoll.distributed": 4,
    "jaxcoll.dp": 4,
    "jaxcoll.parallel": 4,
    "jaxcoll.bench": 5,
    "jaxcoll.nn": 5,
    "jaxcoll": 6,
}
APART = {"jaxcoll._init", "jaxcoll._watch", "jaxcoll.run"}
# Modules that import nothing of jaxcoll and that every unit, those standing apart too, may
# import.
SHARED = {"jaxcoll._jax", "jaxcoll._xla_flags", "jaxcoll.trace"}
# Units above another that still may not import it: beside it in design, above it by layer.
INDEPENDENT = {"jaxcoll.nn": {"jaxcoll.dp"}}
# dp's own floors, lowest first (docs/architecture.md): a part of dp imports only parts on a
# lower floor, so the trainer reads top-down and callbacks sit below the loop and the reports.
DP_FLOORS = {
    "jaxcoll.dp.state": 0,
    "jaxcoll.dp.host": 0,
    "jaxcoll.dp.batchnorm": 0,
    "jaxcoll.dp.callbacks": 0,
    "jaxcoll.dp.layout": 0,
    "jaxcoll.dp.checks": 1,
    "jaxcoll.dp.extra": 1,
    "jaxcoll.dp.specs": 1,
    "jaxcoll.dp.adapters": 2,
    "jaxcoll.dp.data": 2,
    "jaxcoll.dp.hooks": 2,
    "jaxcoll.dp.checkpoint": 2,
    "jaxcoll.dp.sync": 3,
    "jaxcoll.dp.reports": 3,
    "jaxcoll.dp.step": 4,
    "jaxcoll.dp.loop": 4,
    "jaxcoll.dp.trainer": 5,
    "jaxcoll.dp.survivor": 6,
    "jaxcoll.dp": 7,
}
DOOR = "jaxcoll._jax"  # the one module that reaches JAX internals
INTERNAL = ("jax._src", "jax.interpreters", "jax.extend")

# A file's syntax tree by its text: the planted-import cases copy the package and change one
# file, so each parses one file, not all of them again.
parse = functools.lru_cache(maxsize=None)(ast.parse)


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = ["jaxcoll", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def unit_of(module: str) -> str:
    return max((u for u in UNITS if module == u or module.startswith(u + ".")), key=len)


def dp_part(module: str) -> str | None:
    """The part of dp (a top-level module or a sub-package) that ``module`` belongs to."""
    if not (module == "jaxcoll.dp" or module.startswith("jaxcoll.dp.")):
        return None
    return max((u for u in DP_FLOORS if module == u or module.startswith(u + ".")), key=len)


def imports(module: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported jaxcoll module, line, inside a function) for every import in ``path``."""
    tree = parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    local = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            cands = [f"{name}.{a.name}" for a in node.names] + [name]
        elif isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        else:
            continue
        for c in cands:
            if c in known and c != module:
                found.append((c, node.lineno, id(node) in local))
                break
    return found


def violations(root: pathlib.Path) -> list[str]:
    """Every import against the layer order, every function-local import, every circle."""
    mods = modules(root)
    known = set(mods)
    bad, graph = [], {}
    for mod, path in sorted(mods.items()):
        graph[mod] = set()
        unit = unit_of(mod)
        for dep, line, in_function in imports(mod, path, known):
            where = f"{path.relative_to(root.parent)}:{line}"
            dep_unit = unit_of(dep)
            if in_function:
                bad.append(f"{where}: {mod} imports {dep} inside a function")
            if unit in SHARED:
                bad.append(f"{where}: {mod} is shared by every layer but imports {dep}")
            elif unit in APART and dep_unit != unit and dep_unit not in SHARED:
                bad.append(f"{where}: {mod} stands apart but imports {dep}")
            elif dep_unit != unit and UNITS[dep_unit] >= UNITS[unit]:
                bad.append(
                    f"{where}: {mod} (layer {UNITS[unit]}) imports {dep} "
                    f"(layer {UNITS[dep_unit]}), which is not below it"
                )
            elif dep_unit in INDEPENDENT.get(unit, ()):
                bad.append(f"{where}: {mod} imports {dep}, which {unit} is independent of")
            part, dep_part = dp_part(mod), dp_part(dep)
            if part and dep_part and part != dep_part and DP_FLOORS[dep_part] >= DP_FLOORS[part]:
                if not (part == "jaxcoll.dp" and mod == part):  # dp/__init__ re-exports
                    bad.append(
                        f"{where}: {mod} (dp floor {DP_FLOORS[part]}) imports {dep} "
                        f"(dp floor {DP_FLOORS[dep_part]}), which is not below it"
                    )
            if not (mod == unit and dep.startswith(mod + ".")):  # a package re-exporting its own
                graph[mod].add(dep)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                bad.append("import circle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return bad


def jax_internals(root: pathlib.Path) -> list[str]:
    """Every import of (or attribute path into) a JAX internal outside the door module."""
    bad = []
    for mod, path in sorted(modules(root).items()):
        if mod == DOOR:
            continue
        for node in ast.walk(parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names = [f"{node.value.id}.{node.attr}"]
            else:
                continue
            hit = next(
                (n for n in names for i in INTERNAL if n == i or n.startswith(i + ".")), None
            )
            if hit:
                bad.append(
                    f"{path.relative_to(root.parent)}:{node.lineno}: {mod} reaches "
                    f"{hit}, a JAX internal: import it from {DOOR}"
                )
    return bad


def test_imports_point_down_the_layers():
    assert violations(ROOT) == []


def test_only_the_door_reaches_jax_internals():
    assert jax_internals(ROOT) == []
    door = (ROOT / "_jax.py").read_text()
    assert "from jax._src import" in door  # the check above has something to find
    assert imports(DOOR, ROOT / "_jax.py", set(modules(ROOT))) == []  # nothing of jaxcoll


def test_every_module_has_a_layer():
    assert all(unit_of(m) in UNITS for m in modules(ROOT))
    dp = [m for m in modules(ROOT) if m.startswith("jaxcoll.dp")]
    assert all(dp_part(m) in DP_FLOORS for m in dp)
    top = [p for p in (ROOT / "dp").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 12, sorted(p.name for p in top)  # the rest lives in sub-packages
    assert unit_of("jaxcoll.algorithms.ring") == "jaxcoll.algorithms"
    assert unit_of("jaxcoll.groups") == "jaxcoll.groups"


@pytest.mark.parametrize(
    "file, line, expected",
    [
        (
            "_core/ops.py",
            "from jaxcoll import distributed\n",
            "(layer 0) imports jaxcoll.distributed (layer 4)",
        ),
        (
            "algorithms/ring.py",
            "from ..primitives import _all_reduce\n",
            "imports jaxcoll.primitives._all_reduce (layer 2), which is not below it",
        ),
        (
            "dp/__init__.py",
            "from ..distributed import world\n",
            "imports jaxcoll.distributed (layer 4)",
        ),
        (
            "_init/__init__.py",
            "from .._core import ops\n",
            "stands apart but imports jaxcoll._core",
        ),
        ("_xla_flags.py", "from . import _init\n", "is shared by every layer but imports"),
        ("_jax.py", "from ._core import ops\n", "is shared by every layer but imports"),
        ("_core/ops.py", "from jax._src import core\n", "reaches jax._src, a JAX internal"),
        (
            "_watch/process.py",
            "import jax.interpreters.mlir\n",
            "reaches jax.interpreters.mlir, a JAX internal",
        ),
        ("distributed/_group.py", "from jax import _src\n", "reaches jax._src, a JAX internal"),
        ("primitives/_gather.py", "x = jax.extend.core\n", "reaches jax.extend"),
        ("primitives/_gather.py", "def f():\n    from . import _scatter\n", "inside a function"),
        ("distributed/_work.py", "from . import _collectives\n", "import circle: "),
        ("nn/mlp.py", "from ..dp import adapters\n", "which jaxcoll.nn is independent of"),
        (
            "dp/callbacks/base.py",
            "from ..loop import fit\n",
            "(dp floor 0) imports jaxcoll.dp.loop",
        ),
        ("dp/sync/ddp.py", "from ..step import build\n", "(dp floor 4), which is not below it"),
        ("parallel/tensor.py", "from .. import nn\n", "imports jaxcoll.nn (layer 5)"),
    ],
)
def test_the_check_fails_on_a_planted_import(tmp_path, file, line, expected):
    copy = tmp_path / "jaxcoll"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / file, "a") as fh:
        fh.write("\n" + line)
    found = violations(copy) + jax_internals(copy)
    assert any(expected in v for v in found), found


def test_standalone_units_may_import_the_door(tmp_path):
    copy = tmp_path / "jaxcoll"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("_init/__init__.py", "run/__init__.py", "_watch/signals.py"):
        with open(copy / file, "a") as fh:
            fh.write("\nfrom jaxcoll import _jax\n")
    assert violations(copy) == []
