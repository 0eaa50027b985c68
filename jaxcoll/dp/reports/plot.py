"""Plots of a training run: :func:`plot_history` draws ``fit``'s history into a PNG,
:class:`PlotWriter` does it when ``fit`` ends, and :func:`plot_trace` draws the timeline of a
profile trace. Needs matplotlib (drawn with its Agg backend: no display)."""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..callbacks.base import Callback
from ..checks import as_path


def _series(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for h in history:
        v = h.get(key)
        if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
            steps.append(int(h["step"]))
            values.append(float(v))
    return steps, values


def _pyplot(api: str) -> tuple[Any, Any]:
    """``matplotlib`` and ``matplotlib.pyplot`` on the Agg backend (no display), or an
    ImportError naming ``api``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.patches
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise ImportError(
            f"{api} needs matplotlib: pip install matplotlib (or 'jaxcoll[bench]')."
        ) from None
    return matplotlib, plt


def _save(plt: Any, fig: Any, path: str | os.PathLike) -> str:
    """Write ``fig`` as a PNG at ``path`` (its directory created), close it; the path."""
    out = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


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

        >>> state, history = trainer.fit(state, train, steps=500,
        ...                              callbacks=[dp.Evaluate({"val": val})])
        >>> dp.plot_history(history, "out/run.png", title="digits MLP, 8 devices")
    """
    matplotlib, plt = _pyplot("dp.plot_history")
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
    return _save(plt, fig, path)


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
        self.path = as_path("dp.PlotWriter", "path", path, " of a PNG")
        self.title = title

    def on_end(self, step: int, history: list[dict[str, Any]]) -> None:
        if jax.process_index() == 0 and history:
            plot_history(history, self.path, title=self.title)


def _trace_file(profile_dir: str) -> str:
    """The newest ``*.trace.json.gz`` that ``jax.profiler`` wrote under ``profile_dir``."""
    found = glob.glob(os.path.join(profile_dir, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(
            f"dp.plot_trace: no *.trace.json.gz under {profile_dir!r}; pass the directory "
            f"of dp.Profile(directory, steps=...) after fit returned."
        )
    return max(found, key=os.path.getmtime)


def plot_trace(
    profile_dir: str | os.PathLike, path: str | os.PathLike, *, rows: int = 10, names: int = 8
) -> dict[str, Any]:
    """Draw the timeline of a ``jax.profiler`` trace (:class:`~jaxcoll.dp.Profile`'s)
    into a PNG: the ``rows`` busiest threads, one bar per traced event of the runtime and XLA
    (dispatches, executions, ops; not the Python tracer's frames), the ``names`` events with
    the most total time in colour. For a look without TensorBoard or Perfetto.

    Args:
        profile_dir: the directory the trace was written to.
        path: the PNG to write (its directory is created).
        rows: how many threads to show (the busiest).
        names: how many op names get a colour of their own (the rest are grey).

    Returns:
        What was drawn: ``{"file": the trace file, "threads": [(name, busy seconds), ...]
        (the rows), "ops": [(name, total seconds), ...] (every event name, the most time
        first), "span_s": the trace's length}``.

    Example::

        >>> trainer.fit(state, data, steps=20, callbacks=[dp.Profile("prof", steps=(10, 13))])
        >>> dp.plot_trace("prof", "out/trace.png")["ops"][:3]
    """
    matplotlib, plt = _pyplot("dp.plot_trace")
    file = _trace_file(os.fspath(profile_dir))
    spans, label = _timed_events(file)
    busy: dict[Any, float] = {}
    total: dict[str, float] = {}
    for e in spans:
        key = (e.get("pid"), e.get("tid"))
        busy[key] = busy.get(key, 0.0) + e["dur"]
        total[e["name"]] = total.get(e["name"], 0.0) + e["dur"]
    shown = sorted(busy, key=busy.get, reverse=True)[:rows]  # type: ignore[arg-type]
    top = sorted(total, key=total.get, reverse=True)[:names]  # type: ignore[arg-type]
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    cmap = plt.get_cmap("tab10")
    colour = {name: cmap(i % 10) for i, name in enumerate(top)}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(shown) + 1.8))
    for row, key in enumerate(shown):
        bars = [
            ((e["ts"] - t0) / 1e3, e["dur"] / 1e3, colour.get(e["name"], (0.7, 0.7, 0.7, 1)))
            for e in spans
            if (e.get("pid"), e.get("tid")) == key
        ]
        ax.broken_barh(
            [(s, d) for s, d, _ in bars], (row - 0.4, 0.8), facecolors=[c for _, _, c in bars]
        )
    ax.set_yticks(range(len(shown)), [label(k) for k in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.legend(
        handles=[
            matplotlib.patches.Patch(color=colour[n], label=f"{n[:40]} ({total[n] / 1e3:.1f} ms)")
            for n in top
        ],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
    )
    ax.set_title(f"jax.profiler trace: {os.path.basename(file)}", fontsize=9)
    fig.tight_layout()
    _save(plt, fig, path)
    return {
        "file": file,
        "threads": [(label(k), busy[k] / 1e6) for k in shown],
        "ops": [(n, t / 1e6) for n, t in sorted(total.items(), key=lambda kv: -kv[1])],
        "span_s": (t1 - t0) / 1e6,
    }


def _timed_events(file: str) -> tuple[list[dict[str, Any]], Callable[[Any], str]]:
    """The timed events of a trace file, less the Python tracer's frames
    (``$file.py:N function``): the runtime's and XLA's own (dispatches, executions, ops,
    transfers); and each thread's label, by ``(pid, tid)``."""
    with gzip.open(file, "rt") as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    process_names, thread_names = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process_names[e.get("pid")] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread_names[(e.get("pid"), e.get("tid"))] = e["args"]["name"]
    spans = [
        e
        for e in events
        if e.get("ph") == "X" and "dur" in e and "ts" in e and not str(e["name"]).startswith("$")
    ]
    if not spans:
        raise ValueError(f"dp.plot_trace: {file} holds no timed events.")

    def label(key: Any) -> str:
        proc = process_names.get(key[0], str(key[0]))
        return f"{proc} {thread_names.get(key, key[1])}"[:48]

    return spans, label
