"""torch's object collectives in one process (each is a local copy, errors as torch raises
them), and the send/recv protocol on a stand-in key-value store. The real two-process runs
are in tests/multihost (workers/collectives.py)."""

from __future__ import annotations

import pickle

import pytest

from jaxcoll import distributed as dist
from jaxcoll._jax import distributed_state
from jaxcoll.distributed import _objects


def test_single_process_object_collectives_copy_locally():
    objs = [{"lr": 0.1}, "adam", 3]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [{"lr": 0.1}, "adam", 3]
    out = [None]
    assert dist.gather_object({"loss": 0.5}, out, dst=0) is None  # torch returns None
    assert out == [{"loss": 0.5}]
    got = ["old", "kept"]
    dist.scatter_object_list(got, [("for", 0)], src=0)
    assert got == [("for", 0), "kept"]  # only the first entry is set, as in torch


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: dist.gather_object(1, None, dst=0),
            ValueError,
            r"dist.gather_object: on dst=0, object_gather_list must be a list of 1 entries",
        ),
        (lambda: dist.gather_object(1, [None, None], dst=0), ValueError, r"must be a list of 1"),
        (
            lambda: dist.gather_object(1, [None], dst=1),
            ValueError,
            r"dist.gather_object: dst=1 is out of range for a group of 1 ranks",
        ),
        (
            lambda: dist.scatter_object_list([], [1], src=0),
            ValueError,
            r"scatter_object_output_list must be a list of at least one entry",
        ),
        (
            lambda: dist.scatter_object_list([None], [1, 2], src=0),
            ValueError,
            r"on src=0, scatter_object_input_list must hold one object per process \(1\)",
        ),
        (lambda: dist.broadcast_object_list([1], src=2), ValueError, r"src=2 is out of range"),
        (
            lambda: dist.broadcast_object_list([1], group=dist.world()),
            ValueError,
            r"object collectives run over processes .* pass group=None",
        ),
        (
            lambda: dist.send_object_list([1], dst=0),
            ValueError,
            r"dist.send_object_list: dst=0 is this process; the dst of a point-to-point transfer "
            r"must be another process",
        ),
        (
            lambda: dist.recv_object_list([None], src=None),
            ValueError,
            r"src=None \(receive from any process\) is not supported",
        ),
        (lambda: dist.recv_object_list([None], src=3), ValueError, r"src=3 is out of range"),
    ],
)
def test_errors_as_torch_raises_them(call, error, match):
    with pytest.raises(error, match=match):
        call()


class FakeStore:
    """The two calls send/recv make on JAX's distributed client, over a dict."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert key not in self.data
        self.data[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        return self.data[key]

    def key_value_delete(self, key):
        del self.data[key]


def test_send_recv_protocol_in_order_between_two_processes(monkeypatch):
    store = FakeStore()
    me = {"p": 0}
    monkeypatch.setattr(_objects.jax, "process_count", lambda: 2)
    monkeypatch.setattr(_objects.jax, "process_index", lambda: me["p"])
    monkeypatch.setattr(distributed_state(), "client", store)
    monkeypatch.setattr(_objects, "_SENT", type(_objects._SENT)())
    monkeypatch.setattr(_objects, "_RECEIVED", type(_objects._RECEIVED)())
    dist.send_object_list([{"step": 1}, "a"], dst=1)
    dist.send_object_list([{"step": 2}, "b"], dst=1)
    assert sorted(store.data) == ["jaxcoll/objects/0/1/0", "jaxcoll/objects/0/1/1"]
    me["p"] = 1
    got = [None, None]
    assert dist.recv_object_list(got, src=0) == 0  # the sender's rank, as torch returns
    assert got == [{"step": 1}, "a"]
    dist.recv_object_list(got, src=0)
    assert got == [{"step": 2}, "b"] and store.data == {}  # in order; keys deleted
    dist.send_object_list(["x"], dst=0)
    me["p"] = 0
    with pytest.raises(ValueError, match=r"process 1 sent 1 objects but object_list has 2"):
        dist.recv_object_list([None, None], src=1)
    assert pickle.loads(pickle.dumps(got)) == got


def test_send_without_a_distributed_runtime_says_to_init(monkeypatch):
    monkeypatch.setattr(_objects.jax, "process_count", lambda: 2)
    monkeypatch.setattr(_objects.jax, "process_index", lambda: 0)
    monkeypatch.setattr(distributed_state(), "client", None)
    with pytest.raises(RuntimeError, match=r"call jaxcoll.init\(\) first"):
        dist.send_object_list([1], dst=1)


def test_gather_object_on_a_non_destination_must_not_pass_a_list(monkeypatch):
    monkeypatch.setattr(_objects.jax, "process_count", lambda: 2)
    monkeypatch.setattr(_objects.jax, "process_index", lambda: 1)
    monkeypatch.setattr(_objects, "all_gather_object", lambda obj: ["p0", obj])
    dist.gather_object("p1", None, dst=1 - 1)  # fine: returns without touching anything
    with pytest.raises(
        ValueError,
        match=r"object_gather_list must be None on processes other "
        r"than dst=0",
    ):
        dist.gather_object("p1", [None, None], dst=0)
    out = [None, None]
    dist.gather_object("p1", out, dst=1)
    assert out == ["p0", "p1"]
