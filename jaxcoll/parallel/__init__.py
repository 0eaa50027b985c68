"""Model parallelism on jaxcoll's primitives: pipeline (GPipe, 1F1B, interleaved 1F1B),
tensor (Megatron) and expert (MoE token dispatch) parallelism, as functions called inside
``jax.shard_map``.

Why here: these are training recipes, not collectives, so they sit above
:mod:`jaxcoll.primitives` (which they call: ``sendrecv`` for the pipeline's forward and
backward shifts, ``all_reduce``/``reduce_scatter``/``all_gather`` for tensor parallelism,
``ragged_all_to_all`` for MoE) and beside :mod:`jaxcoll.dp`, at the same layer and
independent of it: no flax or optax is needed, and a ``data`` mesh axis composes with any of
them (the pipeline takes ``data_axis=`` and averages gradients over it exactly once).

* :mod:`.pipeline`: :func:`pipeline_value_and_grad`, :func:`pipeline_apply`,
  :func:`bubble_fraction` (the former spelling of the schedules' own);
* :mod:`.staged`: :func:`pipeline_loss`, a schedule behind ``jax.custom_vjp``, for
  a loss that ``jax.grad`` (a ``dp.Trainer``) differentiates;
* :mod:`.schedules`: the schedules as values, :class:`GPipe`, :class:`OneFOneB`,
  :class:`Interleaved`, :class:`ZeroBubble` (:class:`Schedule`), with their bubble and kept
  inputs;
* :mod:`.tensor`: :func:`column_parallel`, :func:`row_parallel`, :func:`mlp`,
  :func:`shard_mlp`, :func:`sequence_gather`, :func:`gelu` (torch's exact ``nn.GELU()``);
* :mod:`.context`: :func:`context_attention` by :class:`Ring` or :class:`Ulysses`, the
  load-balanced sequence layout (:func:`context_order`, :func:`to_context_layout`,
  :func:`from_context_layout`, :func:`context_positions`) and :func:`ring_blocks`;
* :mod:`.moe`: :func:`dispatch`, :func:`combine`; :mod:`.experts`: :func:`moe_mlp` (a
  mixture of experts over an expert axis), :func:`route`, :class:`Load`;
* :mod:`.axes`: :func:`is_bound`, the switch of model code that runs split or dense.
"""

from .axes import is_bound as is_bound
from .context import Ring as Ring
from .context import Ulysses as Ulysses
from .context import context_attention as context_attention
from .context import context_order as context_order
from .context import context_part as context_part
from .context import context_positions as context_positions
from .context import from_context_layout as from_context_layout
from .context import ring_blocks as ring_blocks
from .context import to_context_layout as to_context_layout
from .experts import Load as Load
from .experts import moe_mlp as moe_mlp
from .experts import route as route
from .moe import combine as combine
from .moe import dispatch as dispatch
from .pipeline import bubble_fraction as bubble_fraction
from .pipeline import pipeline_apply as pipeline_apply
from .pipeline import pipeline_value_and_grad as pipeline_value_and_grad
from .schedules import GPipe as GPipe
from .schedules import Interleaved as Interleaved
from .schedules import OneFOneB as OneFOneB
from .schedules import Schedule as Schedule
from .schedules import ZeroBubble as ZeroBubble
from .staged import pipeline_loss as pipeline_loss
from .tensor import column_parallel as column_parallel
from .tensor import gelu as gelu
from .tensor import mlp as mlp
from .tensor import row_parallel as row_parallel
from .tensor import sequence_gather as sequence_gather
from .tensor import shard_mlp as shard_mlp

__all__ = [
    "GPipe",
    "Load",
    "Interleaved",
    "OneFOneB",
    "Ring",
    "Schedule",
    "Ulysses",
    "ZeroBubble",
    "bubble_fraction",
    "column_parallel",
    "combine",
    "context_attention",
    "context_order",
    "context_part",
    "context_positions",
    "from_context_layout",
    "dispatch",
    "gelu",
    "is_bound",
    "mlp",
    "moe_mlp",
    "pipeline_apply",
    "pipeline_loss",
    "pipeline_value_and_grad",
    "ring_blocks",
    "route",
    "row_parallel",
    "sequence_gather",
    "shard_mlp",
    "to_context_layout",
]
