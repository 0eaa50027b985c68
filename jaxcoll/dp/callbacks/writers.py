"""Writers of a run's metrics to files: :class:`JsonlWriter` (one JSON object per line);
TensorBoard's event files are :class:`~jaxcoll.dp.TensorBoardWriter`'s
(:mod:`jaxcoll.dp.reports.tensorboard`)."""

from __future__ import annotations

import json
import os

from .base import ScalarWriter


class JsonlWriter(ScalarWriter):
    """A metric writer: one JSON object per line, ``{"step": s, "loss": ..., ...}``.

    Each step and each evaluation appends one line (evaluation keys prefixed ``eval_``),
    opened and closed per write, so the file is complete whenever the run stops. Also usable
    as a ``clu``-style writer: :meth:`write_scalars`.

    Args:
        path: the file to append to (its directory is created).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(
                json.dumps({"step": int(step), **{k: float(v) for k, v in scalars.items()}}) + "\n"
            )
