"""SyncBatchNorm: BatchNorm whose statistics are taken over the global batch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core.typing import AxisName

if TYPE_CHECKING:
    from flax import linen


def SyncBatchNorm(axis_name: AxisName = "data", **kwargs: Any) -> linen.BatchNorm:  # noqa: N802 (torch's name)
    """``flax.linen.BatchNorm`` with batch statistics averaged over the data axis.

    torch's ``SyncBatchNorm``: each rank computes the mean and mean of squares of its local
    batch, one ``pmean`` per statistic gives the global ones (exact, since every rank holds
    as many examples), so the normalisation and the running averages equal what a single
    device computes on the whole batch. Use it inside a module trained by
    :class:`~jaxcoll.dp.Trainer` over ``axis_name``.

    Args:
        axis_name: the Trainer's data axis.
        **kwargs: passed to ``flax.linen.BatchNorm`` (``momentum``, ``epsilon``,
            ``use_running_average``, ...).

    Example::

        >>> x = SyncBatchNorm(momentum=0.9)(x, use_running_average=not train)
    """
    from flax import linen as nn

    # flax annotates axis_name as str | None; the lax.pmean it is passed to takes a tuple too.
    return nn.BatchNorm(axis_name=axis_name, **kwargs)  # type: ignore[arg-type]
