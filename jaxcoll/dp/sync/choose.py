"""The strategy a Trainer runs: the one it is given, checked against its layout, or the
layout's default. The layout says *which* axes hold the data (replicas, shards); the strategy
says *how* they hold the state; each is said once."""

from __future__ import annotations

from typing import Any

from ..layout import BoundLayout
from .base import Strategy
from .ddp import DDP
from .fsdp import FSDP
from .semisync import DiLoCo
from .zero1 import ZeRO1


def for_layout(api: str, layout: BoundLayout, sync: Any) -> Strategy:
    """``sync`` checked against the bound ``layout``, or the layout's default:
    :class:`~jaxcoll.dp.sync.FSDP` over a shard role (HSDP with replicas beside it),
    :class:`~jaxcoll.dp.sync.DDP` without one. Not yet prepared
    (:meth:`~jaxcoll.dp.sync.Strategy.prepare`).

    Raises:
        TypeError: ``sync`` is no strategy value (a class: the message says to call it).
        ValueError: the strategy and the layout disagree: DDP with a shard role, FSDP or
            ZeRO-1 with replicas alone.
    """
    if sync is not None and not isinstance(sync, Strategy):
        if isinstance(sync, type) and issubclass(sync, Strategy):
            raise TypeError(
                f"{api}: sync=dp.sync.{sync.__name__} is a class: pass a value, e.g. "
                f"sync=dp.sync.{sync.__name__}()."
            )
        raise TypeError(
            f"{api}: sync must be a gradient-sync strategy (dp.sync.DDP(), "
            f"dp.sync.ZeRO1() or dp.sync.FSDP()), got {sync!r} of type "
            f"{type(sync).__name__} instead."
        )
    if isinstance(sync, DiLoCo):  # checks the layout itself when prepared (check_prepared)
        return sync
    given, shard = layout.layout, layout.shard_axis
    if shard is None:
        if sync is None:
            return DDP()
        if given.data_axes and isinstance(sync, ZeRO1):  # FSDP is a ZeRO1
            raise ValueError(
                f"{api}: sync={type(sync).__name__}() splits the state over the data shards, "
                f"and {given!r} has replicas only; give the layout a shard role "
                f"(dp.Layout(shard=...)) for {type(sync).__name__}, or use sync=dp.sync.DDP()."
            )
        return sync
    if sync is not None and not isinstance(sync, ZeRO1):
        raise ValueError(
            f"{api}: sync={type(sync).__name__}() keeps whole params and optimizer state on "
            f"every device, and {given!r} shards them over {shard!r}; for replicas name the "
            f"role replicate= (dp.Layout(replicate=...)), or pass sync=dp.sync.FSDP() or "
            f"dp.sync.ZeRO1()."
        )
    return FSDP() if sync is None else sync
