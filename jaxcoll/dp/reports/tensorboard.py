"""TensorBoard: :class:`TensorBoardWriter` (a callback and a metric writer, with tensorboardX)
and :func:`read_scalars`, which reads the scalars of event files back.

``tensorboardX`` comes with the ``dp`` extra (``pip install jaxcoll[dp]``); TensorBoard
itself is needed only to look at the files (``tensorboard --logdir DIR``).
"""

from __future__ import annotations

import glob
import os
import struct
from typing import Any

import jax

from ..callbacks.base import ScalarWriter
from ..checks import as_path


def _tensorboardx(api: str) -> Any:
    try:
        import tensorboardX
    except ImportError:
        raise ImportError(
            f"{api} needs tensorboardX: pip install 'jaxcoll[dp]' (or 'tensorboardX>=2.6')."
        ) from None
    return tensorboardX


class TensorBoardWriter(ScalarWriter):
    """Write every step's metrics and every evaluation's results to TensorBoard event files.

    A :class:`~jaxcoll.dp.Callback` for ``fit(callbacks=[...])`` and a metric writer
    (``write_scalars(step, scalars)``, clu's interface) usable on its own. Tags are the
    history's keys: ``loss``, ``examples_per_s``, ``mfu``, ... at each step and
    ``eval_<metric>`` (``eval_val_loss`` for a named set) at each evaluation. Only process 0
    writes (``jax.process_index() == 0``; the values are global means, the same on every
    process, except the timings, which are process 0's); the others do nothing. At the end
    of ``fit`` (``on_end``) every event is written out and the file closed (:meth:`close`;
    tensorboardX's own flush leaves the events still queued for its writer thread); a later
    write, e.g. by another ``fit``, opens a new event file in the same directory.

    Args:
        logdir: the directory of the event files (created by process 0).

    Example::

        >>> tb = dp.TensorBoardWriter("runs/exp1")
        >>> state, history = trainer.fit(state, train, steps=1000, callbacks=[tb])
        >>> # tensorboard --logdir runs
    """

    def __init__(self, logdir: str | os.PathLike) -> None:
        self.tbx = _tensorboardx("dp.TensorBoardWriter")
        self.logdir = as_path("dp.TensorBoardWriter", "logdir", logdir)
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        """tensorboardX's ``SummaryWriter`` (opened on first use; None off process 0)."""
        if jax.process_index() != 0:
            return None
        if self._writer is None:
            self._writer = self.tbx.SummaryWriter(self.logdir)
        return self._writer

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        writer = self.writer
        if writer is None:
            return
        for tag, value in scalars.items():
            writer.add_scalar(tag, float(value), int(step))

    def on_end(self, step: int, history: list[dict[str, Any]]) -> None:
        self.close()

    def flush(self) -> None:
        """Flush the event file (events still in tensorboardX's queue may follow later;
        :meth:`close` writes them all)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Write every pending event and close the event file (a later write opens a new
        one)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _masked_crc(data: bytes) -> int:
    from tensorboardX.crc32c import crc32c

    x = crc32c(data) & 0xFFFFFFFF
    return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _records(path: str) -> list[bytes]:
    """The records of a TFRecord file, each length and payload checked against its CRC."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at < len(data):
        if len(data) - at < 12:
            raise ValueError(f"dp.read_scalars: {path} ends inside a record header (at {at}).")
        header = data[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[at + 8 : at + 12])
        if crc != _masked_crc(header):
            raise ValueError(f"dp.read_scalars: {path}: a record's length fails its CRC (at {at}).")
        body = data[at + 12 : at + 12 + length]
        if len(body) < length or len(data) < at + 16 + length:
            raise ValueError(f"dp.read_scalars: {path} ends inside a record (at {at}).")
        (crc,) = struct.unpack("<I", data[at + 12 + length : at + 16 + length])
        if crc != _masked_crc(body):
            raise ValueError(f"dp.read_scalars: {path}: a record fails its CRC (at {at}).")
        out.append(body)
        at += 16 + length
    return out


def read_scalars(path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """The scalars of TensorBoard event files: ``{tag: [(step, value), ...]}`` in file order.

    Args:
        path: an event file (``events.out.tfevents.*``) or a directory whose event files
            (not its subdirectories') are read in name order.

    Each record's CRCs are checked (ValueError on a damaged file). Values are stored as
    float32 (``simple_value``), so they read back rounded to float32.

    Example::

        >>> dp.read_scalars("runs/exp1")["loss"][:2]
        [(1, 1.3862943649291992), (2, 1.2650623321533203)]
    """
    from tensorboardX.proto import event_pb2

    path = os.fspath(path)
    files = sorted(glob.glob(os.path.join(path, "*tfevents*"))) if os.path.isdir(path) else [path]
    if not files:
        raise FileNotFoundError(f"dp.read_scalars: no event file (*tfevents*) in {path}.")
    out: dict[str, list[tuple[int, float]]] = {}
    for name in files:
        for record in _records(name):
            event = event_pb2.Event.FromString(record)
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, []).append((int(event.step), value.simple_value))
    return out
