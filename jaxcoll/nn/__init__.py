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
  :mod:`._params`: what they share (their params, declared whole and boxed with their split).
"""

from .attention import ParallelSelfAttention as ParallelSelfAttention
from .mlp import ParallelMLP as ParallelMLP
from .moe import MoE as MoE

__all__ = [
    "MoE",
    "ParallelMLP",
    "ParallelSelfAttention",
]
