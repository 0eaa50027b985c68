"""Model parallelism on jaxcoll's primitives: pipeline (GPipe, 1F1B, interleaved 1F1B),
tensor (Megatron) and expert (MoE token dispatch) parallelism, as functions called inside
``jax.shard_map``.

Why here: these are training recipes, not collectives, so they sit above
:mod:`jaxcoll.primitives` (which they call: ``sendrecv`` for the pipeline's forward and
backward shifts, ``all_reduce``/``reduce_scatter``/``all_gather`` for tensor parallelism,
``ragged_all_to_all`` for MoE) and beside :mod:`jaxcoll.dp`, at the same layer and
independent of it: no flax or optax is needed, and a ``data`` mesh axis composes with any of
them (the pipeline takes ``data_axis_name=`` and averages gradients over it exactly once).

* :mod:`.pipeline`: :func:`pipeline_value_and_grad`, the pipeline's primitive (it owns the
  step: the loss and this stage's gradient);
* :mod:`.staged`: :func:`pipeline_loss`, the pipeline's loss for a ``dp.Trainer``: a schedule
  behind ``jax.custom_vjp``, for a loss that ``jax.grad`` differentiates;
* :mod:`.schedules`: the schedules as values, :class:`GPipe`, :class:`OneFOneB`,
  :class:`Interleaved`, :class:`ZeroBubble` (:class:`Schedule`), with their bubble and kept
  inputs;
* :mod:`.tensor`: :func:`column_parallel`, :func:`row_parallel`, :func:`mlp`,
  :func:`mlp_specs`, :func:`sequence_gather`, :func:`gelu` (torch's exact ``nn.GELU()``):
  params declared whole, each device handed its slice, dense where the axis is not bound;
* :mod:`.context`: :func:`context_attention` by :class:`Ring` or :class:`Ulysses`, the
  load-balanced sequence order (:func:`context_order`, :func:`to_context_order`,
  :func:`from_context_order`, :func:`context_positions`) and :func:`ring_blocks`;
  :func:`dot_product_attention` (``jax.nn.dot_product_attention`` through the context role)
  and :func:`routed` (puts it in ``jax.nn``'s place while a layout's step is traced);
* :mod:`.moe`: mixtures of experts: :func:`moe_mlp` (the entry: a mixture of experts over
  an expert axis), :func:`dispatch` and :func:`combine` (the tokens' exchange),
  :func:`hierarchical_dispatch` and :func:`hierarchical_combine` (the two-level exchange
  across processes), :class:`Load` and :func:`moe_metrics` (the load and the load-balancing
  loss), :func:`update_expert_bias` (aux-loss-free balancing);
* :mod:`.axes`: :func:`is_bound`, the switch of model code that runs split or dense.
"""

from ._context_route import dot_product_attention as dot_product_attention
from ._context_route import routed as routed
from .axes import is_bound as is_bound
from .context import Ring as Ring
from .context import Ulysses as Ulysses
from .context import context_attention as context_attention
from .context import context_order as context_order
from .context import context_part as context_part
from .context import context_positions as context_positions
from .context import from_context_order as from_context_order
from .context import ring_blocks as ring_blocks
from .context import to_context_order as to_context_order
from .moe import Load as Load
from .moe import combine as combine
from .moe import dispatch as dispatch
from .moe import hierarchical_combine as hierarchical_combine
from .moe import hierarchical_dispatch as hierarchical_dispatch
from .moe import moe_metrics as moe_metrics
from .moe import moe_mlp as moe_mlp
from .moe import update_expert_bias as update_expert_bias
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
from .tensor import mlp_specs as mlp_specs
from .tensor import row_parallel as row_parallel
from .tensor import sequence_gather as sequence_gather

__all__ = [
    "GPipe",
    "Load",
    "Interleaved",
    "OneFOneB",
    "Ring",
    "Schedule",
    "Ulysses",
    "ZeroBubble",
    "column_parallel",
    "combine",
    "context_attention",
    "context_order",
    "context_part",
    "context_positions",
    "from_context_order",
    "dispatch",
    "dot_product_attention",
    "gelu",
    "hierarchical_combine",
    "hierarchical_dispatch",
    "is_bound",
    "mlp",
    "mlp_specs",
    "moe_metrics",
    "moe_mlp",
    "pipeline_loss",
    "pipeline_value_and_grad",
    "ring_blocks",
    "routed",
    "row_parallel",
    "sequence_gather",
    "to_context_order",
    "update_expert_bias",
]
