"""The ``auto`` table: shipped defaults as package data, the user's file over them, and
``jaxcoll-bench --update-table`` writing only the user's file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import jaxcoll
from jaxcoll import algorithms
from jaxcoll.algorithms import auto, registry
from jaxcoll.bench import main
from jaxcoll.bench.tuning import dumps

PACKAGE = Path(jaxcoll.__file__).parent


def _pick(op="all_reduce", nbytes=4096, platform="cpu"):
    return algorithms.choose(
        op, nbytes, group_size=8, two_level=False, platform=platform, topo="single_process"
    )


def _package_hashes() -> dict[str, str]:
    """sha256 of every file of the installed package (bytecode caches aside)."""
    return {
        str(p.relative_to(PACKAGE)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(PACKAGE.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture
def user_file(tmp_path, monkeypatch) -> Path:
    """``JAXCOLL_AUTO_TABLE`` points at a file (not yet written) in a fresh folder."""
    path = tmp_path / "cfg" / "auto_table.json"
    monkeypatch.setenv("JAXCOLL_AUTO_TABLE", str(path))
    return path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_defaults_are_package_data_and_used_without_a_user_file(user_file):
    shipped = json.loads((PACKAGE / "algorithms" / "auto_table.json").read_text())
    assert set(shipped["cpu"]["single_process"]) == set(algorithms.OPS)
    assert not user_file.exists()
    assert algorithms.load_table() == auto.default_table()
    assert auto.default_table()["cpu"]["single_process"]["all_reduce"] == [(None, "native")]
    for op in algorithms.OPS:
        assert _pick(op, 1 << 20) == "native"
    assert not (PACKAGE / "algorithms" / "_table.py").exists()
    assert set(auto.CHOICES) == set(registry.MODULES)  # the names a table may hold


def test_user_table_path_env_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXCOLL_AUTO_TABLE", str(tmp_path / "t.json"))
    assert algorithms.user_table_path() == tmp_path / "t.json"
    monkeypatch.delenv("JAXCOLL_AUTO_TABLE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert algorithms.user_table_path() == tmp_path / "xdg" / "jaxcoll" / "auto_table.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert algorithms.user_table_path() == tmp_path / "home/.cache/jaxcoll/auto_table.json"


def test_user_entries_win_per_op_and_a_rewrite_is_seen(user_file):
    assert _pick() == "native"  # caches the defaults-only table
    _write(
        user_file,
        dumps(
            {
                "cpu": {"single_process": {"all_reduce": [(4096, "tree"), (None, "ring")]}},
                "gpu": {"multi_process": {"broadcast": [(None, "tree")]}},
            }
        ),
    )
    assert _pick(nbytes=4096) == "tree" and _pick(nbytes=4097) == "ring"
    assert _pick("reduce") == "native"  # ops the user file lacks keep the defaults
    assert _pick("broadcast", platform="gpu") == "native"  # other topology
    assert (
        algorithms.choose(
            "broadcast", 4, group_size=8, two_level=False, platform="gpu", topo="multi_process"
        )
        == "tree"
    )
    _write(user_file, dumps({"cpu": {"single_process": {"all_reduce": [(None, "tree")]}}}))
    os.utime(user_file, ns=(1, 1))  # a different mtime even on a coarse clock
    assert _pick(nbytes=1 << 30) == "tree"


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", r"not valid JSON: .* line 1, column 2"),
        ('["cpu"]', r"the top level must be an object, got list"),
        (
            '{"cpu": {"one_process": {}}}',
            r"\['cpu'\]: key 'one_process' is not one of "
            r"single_process, multi_process",
        ),
        ('{"cpu": {"single_process": {"allreduce": []}}}', r"key 'allreduce' is not one of"),
        (
            '{"cpu": {"single_process": {"all_reduce": []}}}',
            r"\['all_reduce'\] must be a non-empty",
        ),
        (
            '{"cpu": {"single_process": {"all_reduce": [["4K", "tree"]]}}}',
            r"\['all_reduce'\]\[0\]: max_bytes must be a non-negative integer or null, got '4K'",
        ),
        (
            '{"cpu": {"single_process": {"all_reduce": [[null, "fast"]]}}}',
            r"algorithm must be one of native, ring, tree, hierarchical, got 'fast'",
        ),
        (
            '{"cpu": {"single_process": {"all_reduce": [[8, "tree"], [4, "ring"]]}}}',
            r"\[1\]: max_bytes must grow from entry to entry, got 4 after 8",
        ),
        (
            '{"cpu": {"single_process": {"all_reduce": [[null, "tree"], [4, "ring"]]}}}',
            r"\[1\] follows an entry with max_bytes null",
        ),
    ],
)
def test_malformed_user_file_raises_naming_it(user_file, text, match):
    _write(user_file, text)
    with pytest.raises(ValueError, match=match) as info:
        _pick()
    assert str(user_file) in str(info.value)
    assert "jaxcoll-bench --update-table" in str(info.value)


def test_update_table_writes_the_user_file_never_the_package(user_file, capsys):
    before = _package_hashes()
    # a user file with another platform's entries, which the update must keep
    _write(user_file, dumps({"gpu": {"single_process": {"reduce": [(None, "tree")]}}}))
    code = main(
        [
            "--ops",
            "all_reduce",
            "--algorithms",
            "tree",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "1K",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--no-progress",
            "--update-table",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert f"# wrote the auto table for cpu to {user_file}" in out
    table = json.loads(user_file.read_text())
    assert table["cpu"]["single_process"]["all_reduce"] == [[None, "tree"]]
    assert table["gpu"]["single_process"]["reduce"] == [[None, "tree"]]
    assert _pick(nbytes=1 << 20) == "tree"  # the new winner (only tree was measured)
    assert _pick("broadcast") == "native"
    assert _package_hashes() == before


def test_table_file_option(tmp_path, user_file, capsys):
    target = tmp_path / "deep" / "dir" / "t.json"
    code = main(
        [
            "--ops",
            "broadcast",
            "--algorithms",
            "ring",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "1K",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--no-progress",
            "--update-table",
            "--table-file",
            str(target),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and f"JAXCOLL_AUTO_TABLE={target}" in out
    assert auto.read_table(target)["cpu"]["single_process"] == {"broadcast": [(None, "ring")]}
    assert not user_file.exists()
    with pytest.raises(SystemExit):
        main(["--table-file", str(target)])
    assert "--table-file is only used with --update-table" in capsys.readouterr().err
