"""The training state a :class:`~jaxcoll.dp.Trainer` steps: one pytree, checkpointed whole."""

from __future__ import annotations

from dataclasses import field

import jax
from flax import struct

from .._core.typing import PyTree


class TrainState(struct.PyTreeNode):
    """Everything a data-parallel run needs to continue exactly where it stopped.

    Attributes:
        params: the model's trainable parameters, replicated on every device; with
            ``sync=dp.sync.FSDP()`` each leaf with a dimension divisible by n
            is split along it (each device holds 1/n), as global ``jax.Array`` s with the
            leaf's real shape.
        opt_state: the optax state, with optax's own structure and shapes. Replicated, or
            with ``sync=dp.sync.ZeRO1()`` or ``dp.sync.FSDP()`` split like the params it mirrors:
            each leaf that mirrors a split param leaf is sharded along the same dimension
            (each device holds 1/n of it), the rest (step counts) replicated. Either way it
            is what an unsharded optax run would hold.
        model_state: non-trainable model variables (BatchNorm statistics), replicated; ``{}``
            for a stateless model.
        step: the number of optimizer steps taken (an int32 scalar). It is also the data
            position: :meth:`Trainer.fit` resumes at batch ``step``.
        rng: the run's base key (raw ``uint32[2]`` key data). Step s on rank r draws from
            ``fold_in(fold_in(rng, s), r)`` (folded again by the micro-batch index when
            ``accum_steps > 1``), so dropout is reproducible and differs per rank.
        extra: state the step carries besides the optimizer's, updated once per step by the
            Trainer's ``extra=`` (:class:`~jaxcoll.dp.Extra`; e.g. :func:`~jaxcoll.dp.ema`
            keeps an exponential moving average of the params here), replicated; ``{}``
            without one. With ``dp.sync.FSDP()`` the leaves that mirror params are
            split like them.
        comm_state: the communication hook's state (:mod:`jaxcoll.dp.hooks`; e.g.
            PowerSGD's low-rank factors and error feedback): one pytree per bucket, each leaf
            with a leading axis of n holding every rank's own state, split over the data
            axis; ``{}`` for a stateless hook.
    """

    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    step: jax.Array
    rng: jax.Array
    extra: PyTree = field(default_factory=dict)
    comm_state: PyTree = field(default_factory=dict)
