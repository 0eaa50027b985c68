"""At a normal exit no jaxcoll thread is left inside a key-value call.

A daemon thread that returns from jaxlib while Python finalizes is unwound by the C library
through jaxlib's frames and the process aborts (SIGABRT) after a job that ended well. The
store here is a stand-in whose reads take a while, as a loaded coordinator's do.
"""

import threading
import time

from jaxcoll._watch import process, signals


class SlowStore:
    """A key-value client whose calls take ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    def key_value_dir_get(self, key: str) -> list:
        self.calls += 1
        time.sleep(self.delay)
        return []


def _fake_job(monkeypatch, store: SlowStore) -> None:
    monkeypatch.setattr(process, "client", lambda: store)
    monkeypatch.setattr(process, "me", lambda: (0, 2))
    monkeypatch.setattr(process, "_kv_broken", False)


def test_join_helpers_waits_for_a_call_in_flight(monkeypatch):
    store = SlowStore(0.4)
    _fake_job(monkeypatch, store)
    # A caller that gave up on its helper (wait_s), leaving the call in flight.
    assert process.kv(lambda c: c.key_value_dir_get("k"), wait_s=0.01) is None
    monkeypatch.setattr(process, "_kv_broken", False)
    helpers = [t for t in threading.enumerate() if t.name == "jaxcoll-kv"]
    assert helpers and all(t.is_alive() for t in helpers)
    process.join_helpers(5.0)
    assert not any(t.is_alive() for t in helpers)


def test_the_preemption_thread_ends_with_the_last_block(monkeypatch):
    store = SlowStore(0.2)
    _fake_job(monkeypatch, store)
    monkeypatch.setattr(signals, "install", lambda: None)  # no SIGTERM handler in a test
    with signals.handle_preemption():
        time.sleep(0.7)  # the thread polls the store meanwhile
        thread = signals._agreement
        assert thread is not None and thread.is_alive() and store.calls >= 1
    # Ended with the block, not at its next poll (or, once woken, after one more call).
    assert not thread.is_alive()
    calls = store.calls
    time.sleep(0.6)
    assert store.calls == calls
