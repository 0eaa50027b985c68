"""The jaxcoll.distributed half of the seed examples prints what the torch programs print."""

from __future__ import annotations

import re

from tests.test_examples import run_example


def dist_rows(out: str, label: str) -> list[str]:
    return re.findall(rf"^dist: rank \d {re.escape(label)} ?[:=] (.*)$", out, flags=re.M)


def test_01_dist_form() -> None:
    out = run_example("01_all_reduce.py")
    assert dist_rows(out, "all_reduce value") == ["[3.0]"] * 2
    assert dist_rows(out, "all_reduce tensor") == [str([[3.0] * 3] * 3)] * 2
    assert dist_rows(out, "all_reduce(MAX) tensor") == ["[2.0, 4.0, 6.0]"] * 2


def test_02_dist_form() -> None:
    out = run_example("02_reduce.py")
    lines = re.findall(r"^(dist: rank \d x = .*)$", out, flags=re.M)
    assert lines == [
        "dist: rank 0 x = [1, 2, 3], y = [2, 3, 4], reduce result = [11, 22, 33]",
        "dist: rank 1 x = [10, 20, 30], y = [11, 21, 31], reduce result = [10, 20, 30]",
    ]
    after = re.findall(r"^dist: rank \d after async reduce (.*)$", out, flags=re.M)
    assert after == [
        "x = [1, 2, 3], y = [4, 5, 6], reduce result = [11, 22, 33]",
        "x = [10, 20, 30], y = [13, 23, 33], reduce result = [10, 20, 30]",
    ]


def test_03_dist_form_with_async() -> None:
    out = run_example("03_collectives.py")
    assert dist_rows(out, "broadcast(src=0)") == ["[1.0]"] * 4
    assert dist_rows(out, "all_reduce") == ["[10.0]"] * 4
    assert dist_rows(out, "reduce(dst=0)") == ["[10.0]", "[2.0]", "[3.0]", "[4.0]"]
    assert dist_rows(out, "scatter(src=0)") == ["[1.0]", "[2.0]", "[3.0]", "[4.0]"]
    zeros = ["[0.0, 0.0, 0.0, 0.0]"] * 3
    assert dist_rows(out, "gather(dst=0)") == ["[1.0, 2.0, 3.0, 4.0]", *zeros]
    assert dist_rows(out, "all_gather") == ["[1.0, 2.0, 3.0, 4.0]"] * 4
    assert dist_rows(out, "send(0 -> 1)") == ["[42.0]", "[42.0]", "[-1.0]", "[-1.0]"]
    assert dist_rows(out, "ring sendrecv") == ["[4.0]", "[1.0]", "[2.0]", "[3.0]"]
    # a group of global ranks 3 and 1: sorted as torch sorts, src a global rank
    assert dist_rows(out, "group [1, 3] broadcast(src=3)") == ["[4.0]", "[4.0]"]
    assert dist_rows(out, "group [1, 3] reduce(group_dst=0)") == ["[6.0]", "[4.0]"]
    assert "dist: other work while all_reduce ran: 65536.0" in out
    assert dist_rows(out, "async all_reduce after wait()") == ["[10.0]"] * 4
