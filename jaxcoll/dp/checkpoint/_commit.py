"""The commit of an asynchronous save across processes, which a lost peer cannot turn into an
abort.

orbax finishes a save in a background thread: each process writes its shards, all meet at a
barrier, process 0 then finalizes the step (its metadata, the rename of the temporary folder).
orbax's default barrier is the coordination service's; when a process is gone, the others
wait in it until JAX declares the peer dead and aborts them (SIGABRT, no Python error), or
until orbax's timeout ("Timed out while waiting for async_write_complete barrier").
:class:`Barriers` is the ``barrier_sync_fn`` jaxcoll gives orbax instead: a barrier in the
job's key-value store that gives up, with a :class:`CommitAbandoned` naming the processes that
did not arrive, as soon as one of them is known to be gone:

* it ended or failed (jaxcoll's ``exited`` and ``failed`` records, :mod:`jaxcoll._watch.process`);
* it gave no sign of life for :data:`STALE_S` seconds after this process was asked to stop
  (SIGTERM: the launcher stopping the job after another process died), or for
  :data:`LOST_S` seconds at any time: while a save is being committed, each process beats
  (:class:`Beacon`) every :data:`BEAT_S` seconds in the store;
* orbax's own deadline passed (``AsyncOptions.timeout_secs``).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..._watch import preemption_requested, process

BEAT_S = 0.5
"""Seconds between two beats of a process whose save is being committed."""
STALE_S = 3.0
"""After this process got SIGTERM: seconds without a beat after which a peer that has not
arrived at a commit barrier is taken for gone."""
LOST_S = 8.0
"""At any time: seconds without a beat after which a peer that has not arrived is taken for
gone: well under jaxcoll's 20 s heartbeat timeout, after which JAX itself aborts the process
(a beat every half second leaves a loaded machine room for 15 missed ones)."""
_POLL_MS = 100


class CommitAbandoned(RuntimeError):
    """A save's commit cannot complete: ``missing`` (process indices) did not arrive."""

    def __init__(self, missing: list[int], why: str) -> None:
        who = (
            f"process {missing[0]}" if len(missing) == 1 else f"processes {process.ranges(missing)}"
        )
        super().__init__(f"{who} {why}")
        self.missing = missing
        self.why = why


def _beat_key(p: int) -> str:
    return f"{process.PREFIX}ckpt-alive/{p}"


_beacons: weakref.WeakSet[Beacon] = weakref.WeakSet()


@atexit.register
def _stop_beacons() -> None:
    """At exit, stop what a save left beating (a save never waited for): a daemon thread
    inside a key-value call when Python finalizes can abort the process."""
    for beacon in list(_beacons):
        beacon.stop()


class Beacon:
    """Beats in the key-value store (a counter under ``ckpt-alive/<me>``) while a save of this
    process is being committed; :meth:`stop` joins the thread, so that no beat is in flight
    when the process exits (at exit at the latest)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        _beacons.add(self)

    def start(self) -> None:
        client = process.client()
        if client is None or process.me()[1] < 2 or self._thread is not None:
            return
        self._stop.clear()
        key = _beat_key(process.me()[0])

        def run() -> None:
            n = 0
            while True:
                n += 1
                try:
                    client.key_value_set(key, str(n), allow_overwrite=True)
                except Exception:  # noqa: BLE001 - the store is gone: nothing to beat for
                    return
                if self._stop.wait(BEAT_S):
                    return

        self._thread = threading.Thread(target=run, name="jaxcoll-ckpt-beacon", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(2 * process.KV_S)
            self._thread = None


class Barriers:
    """orbax's ``barrier_sync_fn`` for one Checkpointer: ``barriers(key=..., timeout_ms=...)``.

    Every process of the job calls orbax's barriers in the same order; ``key`` may repeat
    (orbax reuses some keys at every save), so each use is numbered, under the number of the
    save (:meth:`begin`). Once a barrier was abandoned, every later one of the same save is
    too, at once (orbax's cleanup after a failed commit meets barriers of its own).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._save = 0
        self._uses: dict[str, int] = {}
        self._lock = threading.Lock()
        self.abandoned: CommitAbandoned | None = None

    def begin(self, save: int) -> None:
        """A new save (every process passes the same number: its rendezvous's)."""
        with self._lock:
            self._save, self._uses, self.abandoned = save, {}, None

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        client = process.client()
        me, n = process.me()
        if client is None or n < 2:
            return
        with self._lock:
            if self.abandoned is not None:
                raise self.abandoned
            use = self._uses[key] = self._uses.get(key, -1) + 1
            base = f"{process.PREFIX}ckpt-commit/{self._save}/{key}/{use}/"
        client.key_value_set(base + str(me), "1")
        try:
            self._wait(client, base, me, n, timeout_ms / 1000)
        except CommitAbandoned as e:
            with self._lock:
                self.abandoned = e
            raise

    def _wait(self, client: Any, base: str, me: int, n: int, timeout: float) -> None:
        t0 = time.monotonic()
        arrived = {me}
        beats: dict[int, tuple[str | None, float]] = {}  # peer -> (last beat, when it changed)
        checked = 0.0
        while True:
            for p in range(n):
                if p in arrived:
                    continue
                try:
                    client.blocking_key_value_get(base + str(p), _POLL_MS)
                    arrived.add(p)
                except Exception:  # noqa: BLE001 - not there yet
                    pass
            if len(arrived) == n:
                return
            now = time.monotonic()
            if now - checked < BEAT_S:
                continue
            checked = now
            missing = sorted(set(range(n)) - arrived)
            failed = process.failed()
            for p in missing:
                if p in failed:
                    raise CommitAbandoned([p], f"failed ({failed[p].rstrip('.')})")
            ended = [p for p in missing if p in process.exited()]
            if ended:
                raise CommitAbandoned(ended, "ended")
            limit = STALE_S if preemption_requested() else LOST_S
            silent = []
            for p in missing:
                beat = process.kv(_reader(_beat_key(p)))
                last, since = beats.get(p, (None, t0))
                if beat != last:
                    beats[p] = (beat, now)
                elif now - since >= limit:
                    silent.append((p, now - since))
            if silent and len(silent) == len(missing):
                quiet = min(s for _, s in silent)
                for p, _ in silent:  # what it would record itself: process.leave need not
                    # wait for it (the coordination service's host waits for every "gone")
                    process.kv(_writer(f"{process.PREFIX}gone/{p}"))
                raise CommitAbandoned(
                    [p for p, _ in silent],
                    f"gave no sign of life for {quiet:.0f}s (killed, or its host lost)",
                )
            if now - t0 > timeout:
                raise CommitAbandoned(missing, f"did not finish its part within {timeout:g}s")


def _reader(key: str) -> Callable[[Any], Any]:
    """``client -> the value of key`` (raises when it is missing), for :func:`process.kv`."""
    return lambda c: c.key_value_try_get(key)


def _writer(key: str) -> Callable[[Any], Any]:
    """``client -> set key to "1"``, for :func:`process.kv`."""
    return lambda c: c.key_value_set(key, "1", allow_overwrite=True)
