"""``jaxcoll.init``: join the multi-process job, then return the world group."""

from __future__ import annotations

import functools
from typing import Any

from .. import _init
from ..groups import Group
from ._group import world


@functools.wraps(_init.initialize)
def init(*args: Any, **kwargs: Any) -> Group:
    _init.initialize(*args, **kwargs)
    return world()


init.__name__ = init.__qualname__ = "init"
