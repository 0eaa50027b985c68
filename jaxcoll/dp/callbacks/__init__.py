"""Callbacks of :meth:`Trainer.fit <jaxcoll.dp.Trainer.fit>`: the hooks and actions
(:mod:`.base`), the metric writers (:mod:`.writers`) and the callbacks that act on a metric
(:mod:`.rules`). Each name here is also ``jaxcoll.dp``'s."""

from .base import Action as Action
from .base import Callback as Callback
from .rules import EarlyStopping as EarlyStopping
from .rules import SaveBest as SaveBest
from .writers import JsonlWriter as JsonlWriter

__all__ = [
    "Action",
    "Callback",
    "EarlyStopping",
    "JsonlWriter",
    "SaveBest",
]
