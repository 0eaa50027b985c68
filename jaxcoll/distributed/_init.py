"""``jaxcoll.init``: join the multi-process job, start the watchdog, return the world group."""

from __future__ import annotations

import inspect
from typing import Any

from .. import _init, _watch
from ..groups import Group
from ._group import world

_MORE_ARGS = """\
        timeout: seconds a collective (every ``dist`` call, a :func:`jaxcoll.watch`-ed
            function, outputs given to :func:`jaxcoll.watch_outputs`) may take before the
            watchdog ends this process
            with one line naming it (default 600 in a multi-process job, off in a single
            process, or ``JAXCOLL_TIMEOUT``, set by ``jaxcoll-run --timeout``; 0 = off).
            It counts from when the program became this process's oldest unfinished one.
        debug: ``"detail"`` (or ``JAXCOLL_DEBUG=detail``) checks, at the first use of every
            collective program, that all processes run the same one, and raises on every
            process naming what differs. Costs one key-value round trip per new program.
"""


def init(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: float | None = None,
    debug: str | None = None,
    **kwargs: Any,
) -> Group:
    _watch.configure(timeout if timeout is not None else "env",
                     debug if debug is not None else "env")  # bad values fail before joining
    _init.leave = _watch.leave  # a failure tells the other processes first
    _init.initialize(coordinator_address, num_processes, process_id, **kwargs)
    _watch.start(timeout if timeout is not None else "env", debug if debug is not None else "env")
    return world()


def _document() -> None:
    doc = _init.initialize.__doc__ or ""
    marker = "        fail_fast:"
    init.__doc__ = doc.replace(marker, _MORE_ARGS + marker, 1) if marker in doc else doc
    sig = inspect.signature(_init.initialize)
    params = [p for p in sig.parameters.values()]
    extra = [inspect.Parameter("timeout", inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation="float | None"),
             inspect.Parameter("debug", inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation="str | None")]
    init.__signature__ = sig.replace(parameters=params + extra, return_annotation="Group")


_document()
