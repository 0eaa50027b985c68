"""Flax linen layers for model parallelism: tensor-parallel (Megatron) transformer layers.

Each layer is declared once and serves both runs: outside ``jax.shard_map`` (or with
``axis_name=None``) it is the dense layer on whole params; inside ``shard_map`` over a mesh
with its tensor axis it is handed this device's slices of the params (split as
``flax.linen.get_partition_spec(variables)`` says) and computes through
:mod:`jaxcoll.parallel`'s tensor-parallel functions, which follow the same convention.

Needs flax, which comes with the ``dp`` extra (``pip install "jaxcoll[dp]"``); importing
:mod:`jaxcoll` does not import this package: ``from jaxcoll import nn as tp``.

* :mod:`.mlp`: :class:`ParallelMLP`; :mod:`.moe`: :class:`MoE` (experts over the expert
  axis: the layer of :func:`jaxcoll.parallel.moe_mlp`, its load read by
  :func:`jaxcoll.parallel.moe_metrics`); :mod:`.attention`: :class:`ParallelSelfAttention`;
  :mod:`._params`: what they share (their params, declared whole and boxed with their split);
* :mod:`._nnx`: the layers in flax nnx models (``nnx.bridge.ToNNX``, their splits kept as
  the variables' ``out_sharding`` metadata, which ``dp.Nnx`` reads), and
  :func:`pop_moe_metrics`, an nnx model's MoE loads and auxiliary loss;
* :mod:`.stages`: :func:`stack_blocks`, an nnx model's list of blocks as pipeline stages
  (:class:`BlockStack`, :class:`ModelRest`): stacked params with their ``"layers"`` specs, a
  ``stage_fn`` for :func:`jaxcoll.parallel.pipeline_loss`, and the way back into the model.
"""

from ._nnx import pop_moe_metrics as pop_moe_metrics
from .attention import ParallelSelfAttention as ParallelSelfAttention
from .mlp import ParallelMLP as ParallelMLP
from .moe import MoE as MoE
from .stages import BlockStack as BlockStack
from .stages import ModelRest as ModelRest
from .stages import stack_blocks as stack_blocks

__all__ = [
    "BlockStack",
    "ModelRest",
    "MoE",
    "ParallelMLP",
    "ParallelSelfAttention",
    "pop_moe_metrics",
    "stack_blocks",
]
