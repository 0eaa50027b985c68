"""jaxcoll-bench runs, checks every result (#wrong 0), and writes csv/json/plot."""

from __future__ import annotations

import json

import pytest

from jaxcoll import algorithms
from jaxcoll.bench import main, parse_args, parse_bytes
from jaxcoll.bench.output import format_row, header


def test_bench_small_table(tmp_path, capsys):
    out_json = tmp_path / "rows.json"
    code = main(
        [
            "--ops",
            "all_reduce,reduce_scatter,broadcast",
            "--algorithms",
            "native,ring,tree",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "2K",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--no-progress",
            "--json",
            str(out_json),
            "--csv",
            str(tmp_path / "rows.csv"),
            "--plot",
            str(tmp_path / "bw.png"),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    assert "memory copy bandwidth" in text and "busbw(GB/s)" in text
    rows = json.loads(out_json.read_text())
    assert len(rows) == 3 * 3 * 2
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)
    assert {r["bytes"] for r in rows if r["op"] == "all_reduce"} == {1024, 2048}
    ar = next(r for r in rows if r["op"] == "all_reduce")
    assert ar["busbw"] == pytest.approx(ar["algbw"] * 2 * 7 / 8)
    assert (tmp_path / "bw.png").stat().st_size > 0
    assert (tmp_path / "rows.csv").read_text().startswith("op,algorithm,bytes")


def test_parse_bytes_and_table_from_results():
    assert parse_bytes("4K") == 4096 and parse_bytes("16M") == 16 << 20
    assert parse_bytes("100") == 100
    rows = [
        {"op": "all_reduce", "algorithm": "native", "bytes": 4096, "time_us": 5.0},
        {"op": "all_reduce", "algorithm": "tree", "bytes": 4096, "time_us": 4.0},
        {"op": "all_reduce", "algorithm": "native", "bytes": 8192, "time_us": 5.0},
        {"op": "all_reduce", "algorithm": "ring", "bytes": 8192, "time_us": 9.0},
        {"op": "all_reduce", "algorithm": "ring", "bytes": 16384, "time_us": 1.0, "wrong": 3},
        {"op": "all_reduce", "algorithm": "native", "bytes": 16384, "time_us": 7.0},
    ]
    table = algorithms.table_from_results(rows, platform="cpu", topo="single_process")
    entries = table["cpu"]["single_process"]["all_reduce"]
    assert entries == [(4096, "tree"), (None, "native")]  # the wrong ring row never wins

    def pick(b):
        return algorithms.choose(
            "all_reduce",
            b,
            group_size=8,
            two_level=False,
            platform="cpu",
            topo="single_process",
            table=table,
        )

    assert pick(100) == "tree" and pick(4096) == "tree" and pick(1 << 30) == "native"
    assert (
        algorithms.choose(
            "all_reduce",
            100,
            group_size=1,
            two_level=False,
            table=table,
            platform="cpu",
            topo="single_process",
        )
        == "native"
    )


def test_auto_is_native_for_small_messages_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCOLL_AUTO_TABLE", str(tmp_path / "none.json"))  # defaults only
    for op in algorithms.OPS:
        assert (
            algorithms.choose(
                op, 4096, group_size=8, two_level=False, platform="cpu", topo="single_process"
            )
            == "native"
        )


def test_launcher_variables_are_the_defaults(monkeypatch):
    """jaxcoll-run sets JAXCOLL_COORDINATOR_ADDRESS, JAXCOLL_NUM_PROCESSES, JAXCOLL_PROCESS_ID
    and, with --devices-per-proc, JAX_NUM_CPU_DEVICES."""
    monkeypatch.delenv("JAXCOLL_COORDINATOR", raising=False)
    monkeypatch.setenv("JAXCOLL_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    monkeypatch.setenv("JAXCOLL_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXCOLL_PROCESS_ID", "1")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "4")
    a = parse_args([])
    assert (a.coordinator, a.num_processes, a.process_id, a.devices) == ("127.0.0.1:1234", 2, 1, 4)
    assert parse_args(["--coordinator", "h:1"]).coordinator == "h:1"
    monkeypatch.delenv("JAXCOLL_COORDINATOR_ADDRESS")
    monkeypatch.setenv("JAXCOLL_COORDINATOR", "old:5")
    assert parse_args([]).coordinator == "old:5"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--ops", "allreduce"], "--ops: 'allreduce' is not one of all_reduce, all_gather"),
        (
            ["--algorithms", "fast"],
            "--algorithms: 'fast' is not one of native, ring, tree, hierarchical, auto",
        ),
        (["--min-bytes", "2K", "--max-bytes", "1K"], "--min-bytes 2048 is larger than"),
        (["--mesh", "2by4"], "--mesh: expected OUTERxINNER such as 2x4, got '2by4'"),
        (["--table-file", "t.json"], "--table-file is only used with --update-table"),
    ],
)
def test_bad_arguments_exit_naming_the_flag(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2 and match in capsys.readouterr().err


def test_row_format_is_fixed_width():
    row = {
        "op": "all_reduce",
        "algorithm": "ring",
        "bytes": 4096,
        "count": 1024,
        "dtype": "float32",
        "time_us": 12.345,
        "algbw": 0.5,
        "busbw": 0.875,
        "wrong": 0,
    }
    assert format_row(row) == (
        "  all_reduce     ring               4K       1024  float32"
        "        12.3        0.500        0.875       0"
    )
    assert header(["x"]).splitlines() == [
        "# x",
        "# op             algorithm        size      count    dtype    time(us)"
        "  algbw(GB/s)  busbw(GB/s)  #wrong",
    ]
