"""jaxcoll.init: _init.initialize's parameters plus its own (fail_fast and the watchdog's), each
documented and each passed on.

Joining a real job is tested in tests/multihost (test_multiprocess.py, test_faults.py,
test_hangs.py).
"""

from __future__ import annotations

import inspect

import pytest

import jaxcoll
from jaxcoll import _init, _watch
from jaxcoll.distributed import init

WATCHDOG = ("timeout", "debug", "first_timeout")  # init's own parameters, for _watch
OWN = ("fail_fast", *WATCHDOG)  # init's own parameters


def test_init_has_initializes_parameters_plus_its_own():
    ours = inspect.signature(init).parameters
    joining = inspect.signature(_init.initialize).parameters
    assert [name for name in ours if name not in OWN] == list(joining)
    assert set(ours) == {*joining, *OWN}
    for name, p in joining.items():
        assert ours[name].kind == p.kind, name
        assert ours[name].default == p.default, name
        assert ours[name].annotation == p.annotation, name
    for name in OWN:
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert ours[name].default is (True if name == "fail_fast" else None)
    assert jaxcoll.init is init is jaxcoll.distributed.init


def test_init_documents_every_parameter():
    doc = inspect.getdoc(init)
    args = doc[doc.index("\nArgs:\n") : doc.index("\nReturns:\n")]
    documented = [
        line.split(":")[0].strip()
        for line in args.splitlines()[2:]
        if line.startswith("    ") and not line.startswith("     ")
    ]
    assert documented == list(inspect.signature(init).parameters)


class _Stop(Exception):
    pass


def test_init_passes_every_argument_on(monkeypatch):
    """Each argument reaches _init.initialize (or the watchdog) unchanged, by its own name."""
    joined, configured = [], []
    joining = inspect.signature(_init.initialize)

    def initialize(*args, **kwargs):
        joined.append(joining.bind(*args, **kwargs).arguments)
        raise _Stop  # joined nothing: stop before the watchdog starts

    monkeypatch.setattr(_init, "initialize", initialize)
    monkeypatch.setattr(_watch, "configure", lambda *args: configured.append(args))
    sent = {name: object() for name in inspect.signature(init).parameters}
    with pytest.raises(_Stop):
        init(**sent)
    assert configured == [tuple(sent[name] for name in WATCHDOG)]
    assert joined == [{k: v for k, v in sent.items() if k not in OWN}]


@pytest.mark.parametrize("fail_fast", [True, False])
def test_a_joined_job_fails_fast_by_the_watchdogs_leave(monkeypatch, fail_fast):
    """Only a joined job gets the fail-fast excepthook, ending the process by _watch.leave
    (which tells the other processes first)."""
    hooked = []
    monkeypatch.setattr(_watch, "configure", lambda *args: None)
    monkeypatch.setattr(_watch, "start", lambda *args: None)
    monkeypatch.setattr(_init, "fail_fast", hooked.append)
    for joined in (False, True):
        monkeypatch.setattr(_init, "initialize", lambda *args, _j=joined, **kwargs: _j)
        init(fail_fast=fail_fast)
    assert hooked == ([_watch.leave] if fail_fast else [])
