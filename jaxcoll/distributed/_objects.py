"""Host-level helpers: send picklable Python objects between processes.

torch's object collectives under torch's names, where a rank is a PROCESS
(``jax.process_index()``): ``broadcast_object_list``, ``gather_object``,
``scatter_object_list``, ``send_object_list``/``recv_object_list``, plus jaxcoll's returning
forms ``broadcast_object`` and ``all_gather_object``. With one process each is a local copy.
The collective ones ride on ``jax.experimental.multihost_utils`` (every process calls them, as
in torch); send/recv use the key-value store of JAX's distributed runtime, so only the two
processes involved call them, as in torch.
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from .._core.checks import check_rank
from .._jax import distributed_state


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Every process gets process ``src``'s ``obj`` (any picklable object).

    ``torch.distributed.broadcast_object_list([obj], src)``, returning the object instead of
    filling a list. ``src`` is a process index (``jax.process_index()``), not a device rank.
    With one process it returns ``obj`` at once. Otherwise: pickle on ``src``, then two
    ``multihost_utils.broadcast_one_to_all`` calls (the byte count, then the bytes). Every
    process must call it.

    .. warning::
        Every other process runs ``pickle.loads`` on the bytes process ``src`` sends, and
        unpickling runs code chosen by whoever wrote those bytes. As with
        ``torch.distributed.broadcast_object_list``, use it only in a job whose processes and
        network you trust (the coordinator has no authentication; see "Trust model" in
        docs/failing-fast.md); send arrays or plain data otherwise.

    Example (one process)::

        >>> dist.broadcast_object({"lr": 0.1})
        {'lr': 0.1}
    """
    api = "dist.broadcast_object"
    count = jax.process_count()
    src = check_rank(api, "src", src, count)
    if count == 1:
        return obj
    is_source = jax.process_index() == src
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if is_source else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(payload.size), is_source=is_source))
    buf = payload if is_source else np.zeros(size, np.uint8)
    data = multihost_utils.broadcast_one_to_all(buf, is_source=is_source)
    return obj if is_source else pickle.loads(np.asarray(data).tobytes())


def all_gather_object(obj: Any) -> list[Any]:
    """Every process gets the list of every process's ``obj``, in process order.

    ``torch.distributed.all_gather_object(object_list, obj)``, returning the list. With one
    process it returns ``[obj]`` at once. Otherwise: pickle, ``multihost_utils.process_allgather``
    of the byte counts, then of the bytes padded to the longest. Every process must call it.

    .. warning::
        Every process runs ``pickle.loads`` on the bytes each other process sends, and
        unpickling runs code chosen by whoever wrote those bytes. As with
        ``torch.distributed.all_gather_object``, use it only in a job whose processes and
        network you trust (the coordinator has no authentication; see "Trust model" in
        docs/failing-fast.md); gather arrays or plain data otherwise.

    Example (one process)::

        >>> dist.all_gather_object("hello")
        ['hello']
    """
    if jax.process_count() == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(payload.size))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: payload.size] = payload
    data = np.asarray(multihost_utils.process_allgather(buf))
    return [pickle.loads(data[i, : int(n)].tobytes()) for i, n in enumerate(sizes)]


# ---------------------------------------------------------------- torch's object collectives
def _no_group(api: str, group: Any) -> None:
    if group is not None:
        raise ValueError(
            f"{api}: group={group!r}: object collectives run over processes (a "
            f"rank here is jax.process_index()), and jaxcoll's groups are groups "
            f"of devices; pass group=None."
        )


def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: Any = None, device: Any = None
) -> None:
    """Fill every process's ``object_list`` in place with process ``src``'s objects.

    ``torch.distributed.broadcast_object_list(object_list, src, group, device)``: every
    process passes a list of the same length; on return each holds ``src``'s objects (``src``
    is a process index). Returns None, as torch does. Lowering: :func:`broadcast_object` of
    the list. ``device`` is accepted and ignored (torch uses it to stage the bytes).

    .. warning::
        Non-source processes unpickle bytes sent by process ``src``, and unpickling can run
        arbitrary code: only use it between trusted processes (torch's docs say the same).

    Raises:
        ValueError: this process's list has another length than ``src``'s (checked after the
            transfer, so no process is left waiting), or a group is passed.

    Example (one process)::

        >>> objs = [{"lr": 0.1}, "adam"]
        >>> dist.broadcast_object_list(objs, src=0)
        >>> objs
        [{'lr': 0.1}, 'adam']
    """
    api = "dist.broadcast_object_list"
    _no_group(api, group)
    got = broadcast_object(list(object_list), src)
    if len(got) != len(object_list):
        raise ValueError(
            f"{api}: this process passed a list of {len(object_list)} objects but "
            f"process {src} sent {len(got)}; every process must pass a list of "
            f"the same length."
        )
    object_list[:] = got


def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
) -> None:
    """Process ``dst`` gets every process's ``obj`` in ``object_gather_list``, in process order.

    ``torch.distributed.gather_object(obj, object_gather_list, dst, group)``: on ``dst``
    ``object_gather_list`` must be a list of ``jax.process_count()`` entries, filled in place;
    on every other process it must be None. Returns None, as torch does. Lowering:
    :func:`all_gather_object` (every process receives every object; the others discard them).

    .. warning::
        Process ``dst`` unpickles bytes sent by the others, and unpickling can run arbitrary
        code: only use it between trusted processes (torch's docs say the same).

    Raises:
        ValueError: the list is missing or of the wrong size on ``dst``, or given elsewhere
            (as torch raises); checked after the transfer, so no process is left waiting.

    Example (one process)::

        >>> out = [None]
        >>> dist.gather_object({"loss": 0.5}, out, dst=0)
        >>> out
        [{'loss': 0.5}]
    """
    api = "dist.gather_object"
    _no_group(api, group)
    count = jax.process_count()
    dst = check_rank(api, "dst", dst, count)
    objs = all_gather_object(obj)
    if jax.process_index() != dst:
        if object_gather_list is not None:
            raise ValueError(
                f"{api}: object_gather_list must be None on processes other than "
                f"dst={dst} (as in torch); got {object_gather_list!r}."
            )
        return
    if not isinstance(object_gather_list, list) or len(object_gather_list) != count:
        raise ValueError(
            f"{api}: on dst={dst}, object_gather_list must be a list of {count} "
            f"entries (one per process) to fill; got {object_gather_list!r}."
        )
    object_gather_list[:] = objs


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: Sequence[Any] | None = None,
    src: int = 0,
    group: Any = None,
) -> None:
    """Process p gets ``scatter_object_input_list[p]`` of process ``src`` in its output list.

    ``torch.distributed.scatter_object_list(output_list, input_list, src, group)``: on ``src``
    the input list holds one object per process (elsewhere it is ignored); each process's
    ``scatter_object_output_list[0]`` is set to its object. Returns None, as torch does.
    Lowering: :func:`broadcast_object` of the whole input list (every process receives every
    object and keeps its own).

    .. warning::
        Every process unpickles bytes sent by process ``src`` (all of its objects, not only
        its own), and unpickling can run arbitrary code: only use it between trusted
        processes (torch's docs say the same).

    Raises:
        ValueError: the output list is not a non-empty list, or ``src``'s input list does not
            hold one object per process (raised on every process, none is left waiting).

    Example (one process)::

        >>> out = [None]
        >>> dist.scatter_object_list(out, ["for process 0"], src=0)
        >>> out
        ['for process 0']
    """
    api = "dist.scatter_object_list"
    _no_group(api, group)
    count = jax.process_count()
    src = check_rank(api, "src", src, count)
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError(
            f"{api}: scatter_object_output_list must be a list of at least one "
            f"entry (its first entry receives the object); got "
            f"{scatter_object_output_list!r}."
        )
    payload: Any = None
    if jax.process_index() == src:
        objs = scatter_object_input_list
        if isinstance(objs, Sequence) and not isinstance(objs, (str, bytes)) and len(objs) == count:
            payload = list(objs)
        else:
            payload = _Bad(
                f"{api}: on src={src}, scatter_object_input_list must hold one object "
                f"per process ({count}); got {objs!r}."
            )
    payload = broadcast_object(payload, src)
    if isinstance(payload, _Bad):
        raise ValueError(payload.message)
    scatter_object_output_list[0] = payload[jax.process_index()]


class _Bad:
    """A source's argument error, sent instead of the data so that every process raises."""

    def __init__(self, message: str):
        self.message = message


_SENT: collections.Counter[tuple[int, int]] = collections.Counter()
_RECEIVED: collections.Counter[tuple[int, int]] = collections.Counter()


def _client(api: str) -> Any:
    client = getattr(distributed_state(), "client", None)
    if client is None:
        raise RuntimeError(
            f"{api}: JAX's distributed runtime is not initialized; call "
            f"jaxcoll.init() first (and start the processes with jaxcoll-run)."
        )
    return client


def _peer(api: str, argname: str, value: Any) -> int:
    count = jax.process_count()
    value = check_rank(api, argname, value, count)
    if value == jax.process_index():
        raise ValueError(
            f"{api}: {argname}={value} is this process; the {argname} of a "
            f"point-to-point transfer must be another process (as torch requires)."
        )
    return value


def send_object_list(
    object_list: list[Any], dst: int, group: Any = None, device: Any = None
) -> None:
    """Send ``object_list`` (picklable objects) to process ``dst``; only ``dst`` must match it.

    ``torch.distributed.send_object_list(object_list, dst, group, device)``: ``dst`` calls
    :func:`recv_object_list` with a list of the same length. Messages between two processes
    arrive in the order sent. Lowering: the pickled list is stored under a per-pair sequence
    number in the key-value store of JAX's distributed runtime (the coordinator), so only the
    two processes take part and nothing blocks the sender. ``device`` is accepted and
    ignored. Fit for configs and small metadata, not bulk data: the bytes pass through the
    coordinator.

    .. warning::
        Process ``dst`` unpickles what this process sends, and unpickling can run arbitrary
        code: only use it between trusted processes (torch's docs say the same).

    Raises:
        ValueError: ``dst`` is out of range or this process (torch raises too: with one
            process there is no peer).

    Example (process 0 of 2)::

        >>> dist.send_object_list([{"step": 10}], dst=1)
    """
    api = "dist.send_object_list"
    _no_group(api, group)
    dst = _peer(api, "dst", dst)
    me = jax.process_index()
    seq = _SENT[(me, dst)]
    _client(api).key_value_set_bytes(
        f"jaxcoll/objects/{me}/{dst}/{seq}", pickle.dumps(list(object_list))
    )
    _SENT[(me, dst)] += 1


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    *,
    timeout: float = 1800.0,
) -> int:
    """Receive the list process ``src`` sent with :func:`send_object_list`, in place.

    ``torch.distributed.recv_object_list(object_list, src, group, device)``: fills
    ``object_list`` (the same length as the sent list) and returns the sender's rank.
    Waits up to ``timeout`` seconds (torch's default process-group timeout, 30 minutes).

    .. warning::
        This unpickles what process ``src`` sent, and unpickling can run arbitrary code: only
        use it between trusted processes (torch's docs say the same).

    Raises:
        ValueError: ``src`` is None (torch's receive-from-any-process is not supported: name
            the sender), out of range or this process; or the list lengths differ.

    Example (process 1 of 2)::

        >>> got = [None]
        >>> dist.recv_object_list(got, src=0)
        0
        >>> got
        [{'step': 10}]
    """
    api = "dist.recv_object_list"
    _no_group(api, group)
    if src is None:
        raise ValueError(
            f"{api}: src=None (receive from any process) is not supported; pass "
            f"the sender's process index as src."
        )
    src = _peer(api, "src", src)
    me = jax.process_index()
    key = f"jaxcoll/objects/{src}/{me}/{_RECEIVED[(src, me)]}"
    client = _client(api)
    data = client.blocking_key_value_get_bytes(key, int(timeout * 1000))
    client.key_value_delete(key)
    _RECEIVED[(src, me)] += 1
    got = pickle.loads(data)
    if len(got) != len(object_list):
        raise ValueError(
            f"{api}: process {src} sent {len(got)} objects but object_list has "
            f"{len(object_list)} entries; pass a list of the sent length."
        )
    object_list[:] = got
    return src
