"""busbw against size, one panel per op (needs matplotlib: ``pip install jaxcoll[bench]``)."""

from __future__ import annotations

from .cases import OPS


def plot_busbw(rows: list[dict], path: str) -> None:
    """Write a PNG with one panel per op and one line per algorithm to ``path``."""
    import matplotlib  # optional: only ``--plot`` needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows}, key=OPS.index)
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for alg in dict.fromkeys(r["algorithm"] for r in rows if r["op"] == op):
            pts = [
                (r["bytes"], r["busbw"]) for r in rows if r["op"] == op and r["algorithm"] == alg
            ]
            ax.plot(*zip(*pts), marker="o", label=alg)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{op}, {rows[0]['devices']} devices")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
