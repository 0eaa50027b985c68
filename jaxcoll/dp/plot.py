"""Plots of a training run: :func:`plot_history` draws ``fit``'s history into a PNG, and
:class:`PlotWriter` does it when ``fit`` ends. Needs matplotlib (drawn with its Agg backend:
no display)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import jax

from .callbacks import Callback


def _series(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for h in history:
        v = h.get(key)
        if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
            steps.append(int(h["step"]))
            values.append(float(v))
    return steps, values


def plot_history(
    history: Sequence[dict[str, Any]], path: str | os.PathLike, *, title: str | None = None
) -> str:
    """Draw a history of :meth:`Trainer.fit <jaxcoll.dp.Trainer.fit>` against the step into
    a PNG at ``path``; returns the path.

    Panels, each drawn when the history has its values: the training ``loss`` with every
    evaluation loss (``eval_loss``, ``eval_<name>_loss``) as points, on a log scale; the
    other evaluation metrics (``eval_accuracy``, ...); the throughput (``tokens_per_s`` if
    logged, else ``examples_per_s``); ``mfu``.

    Args:
        history: ``fit``'s history (a list of dicts with ``step``), or any such list.
        path: the PNG to write (its directory is created).
        title: the figure's title.

    Example::

        >>> state, history = trainer.fit(state, train, steps=500, eval_data={"val": val})
        >>> dp.plot_history(history, "out/run.png", title="digits MLP, 8 devices")
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise ImportError(
            "dp.plot_history needs matplotlib: pip install matplotlib (or 'jaxcoll[bench]')."
        ) from None
    keys: list[str] = []
    for h in history:
        keys += [k for k in h if k not in keys]
    eval_losses = [k for k in keys if k.startswith("eval_") and k.endswith("loss")]
    eval_other = [k for k in keys if k.startswith("eval_") and k not in eval_losses]
    speed = "tokens_per_s" if "tokens_per_s" in keys else "examples_per_s"
    panels: list[tuple[str, list[str]]] = []
    if "loss" in keys or eval_losses:
        panels.append(("loss", [k for k in ["loss", *eval_losses] if k in keys]))
    if eval_other:
        panels.append(("evaluation", eval_other))
    if speed in keys:
        panels.append((speed.replace("_per_s", " / s"), [speed]))
    if "mfu" in keys:
        panels.append(("MFU", ["mfu"]))
    if not panels:
        raise ValueError(
            f"dp.plot_history: the history has nothing to plot (keys: {keys}); pass the "
            f"history Trainer.fit returned (a list of dicts with 'step' and 'loss')."
        )
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(7, 2.4 * len(panels) + 0.4), sharex=True, squeeze=False
    )
    for ax, (label, names) in zip(axes[:, 0], panels):
        for name in names:
            steps, values = _series(history, name)
            if not steps:
                continue
            evaluated = name.startswith("eval_")
            ax.plot(
                steps,
                values,
                marker="o" if evaluated else None,
                ms=3,
                lw=1.5 if evaluated else 1,
                label=name,
            )
        ax.set_ylabel(label)
        if label == "loss" and all(v > 0 for n in names for v in _series(history, n)[1]):
            ax.set_yscale("log")  # a loss spans decades
        if label == "MFU":
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(alpha=0.3)
        if len(names) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class PlotWriter(Callback):
    """A callback that draws the run's history (:func:`plot_history`) into a PNG when
    ``fit`` ends; only process 0 draws.

    Args:
        path: the PNG to write.
        title: the figure's title.

    Example::

        >>> trainer.fit(state, train, steps=500, callbacks=[dp.PlotWriter("out/run.png")])
    """

    def __init__(self, path: str | os.PathLike, *, title: str | None = None) -> None:
        try:
            self.path = os.path.abspath(os.fspath(path))
        except TypeError:
            raise TypeError(
                f"dp.PlotWriter: path must be a path (str or os.PathLike) of a PNG, got "
                f"{type(path).__name__} instead."
            ) from None
        self.title = title

    def on_end(self, step: int, history: list[dict[str, Any]]) -> None:
        if jax.process_index() == 0 and history:
            plot_history(history, self.path, title=self.title)
