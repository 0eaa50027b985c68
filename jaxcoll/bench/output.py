"""What the benchmark prints and writes: the header, one line per row, CSV and JSON files."""

from __future__ import annotations

import csv
import json
import sys

# (title, width) of each printed column after the leading "  "; the header starts with "# ".
COLUMNS = (
    ("op", -15),
    ("algorithm", -13),
    ("size", 8),
    ("count", 11),
    ("dtype", 9),
    ("time(us)", 12),
    ("algbw(GB/s)", 13),
    ("busbw(GB/s)", 13),
    ("#wrong", 8),
)


def human(nbytes: int) -> str:
    """``4096`` -> ``"4K"``, ``16777216`` -> ``"16M"``; other sizes as plain bytes."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _cells(values) -> str:
    return "".join(f"{v:<{-w}}" if w < 0 else f"{v:>{w}}" for v, (_, w) in zip(values, COLUMNS))


def header(banner: list[str]) -> str:
    """The ``# ``-prefixed banner lines, then the column titles."""
    return "\n".join(f"# {line}" for line in banner + [_cells(t for t, _ in COLUMNS)])


def format_row(row: dict) -> str:
    """One result row as a line of the table."""
    return "  " + _cells(
        (
            row["op"],
            row["algorithm"],
            human(row["bytes"]),
            row["count"],
            row["dtype"],
            f"{row['time_us']:.1f}",
            f"{row['algbw']:.3f}",
            f"{row['busbw']:.3f}",
            row["wrong"],
        )
    )


class Progress:
    """A tqdm bar on stderr when wanted and installed; rows still go to stdout either way."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, file=sys.stderr, leave=False, unit="row")

    def row(self, line: str | None) -> None:
        """Advance the bar by one row and print ``line`` (None: print nothing)."""
        if self.bar is not None:
            self.bar.update(1)
        if line is not None:
            if self.bar is not None:
                self.bar.write(line, file=sys.stdout)
            else:
                print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_csv(rows: list[dict], path: str) -> None:
    """One line per row, with a header of the row keys."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_json(rows: list[dict], path: str) -> None:
    """The rows as a JSON list of objects."""
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1)
