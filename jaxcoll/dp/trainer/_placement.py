"""Where a :class:`~jaxcoll.dp.Trainer` places batches and state: the batch's sharding, and the
params' model specs, found once at init, against which a state's placement is checked.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..._core.scheduled import Scheduled
from ..._core.typing import PyTree
from ..data.batches import leading_size, placed_as
from ..layout import BoundLayout
from ..specs import check_placed_specs, model_specs, restrict
from ..step.honoured import tensor_split
from ..sync import Strategy


class _Specs(NamedTuple):
    """The params' model specs, known at init (or from the first state's placement), and
    where a state this Trainer placed holds each leaf: a state placed so carries its specs."""

    model: tuple[P, ...]  # each leaf's model spec, P() for a whole one
    held: tuple[NamedSharding, ...]  # each leaf's sharding in the Trainer's state


class _Placement:
    """The placement half of :class:`~jaxcoll.dp.Trainer` (its base): the batch's sharding and
    its check, the model specs kept at init and the check of a state's placement against them."""

    # Set by Trainer.__init__.
    layout: BoundLayout
    sync: Strategy
    accum_steps: int
    _specs: _Specs | None
    _placed: Any
    _step_fns: dict[Any, Any]
    _eval_fn: Scheduled | None

    # ----------------------------------------------------------------------------- placement
    def _check_batch(self, batch: PyTree, api: str) -> None:
        accum = self.accum_steps if api == "Trainer.step" else 1
        self.layout.split.check(api, batch, leading_size(api, batch), accum)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a global batch goes: split along its leading axis over the data axes
        (``P(axis_name)``), replicated over the model's axes (and whole along the sequence
        over a context axis: each device takes its part of it inside the step). A data
        pipeline whose processes each read only their rows places them with it
        (``jax.make_array_from_process_local_data(trainer.batch_sharding, rows, shape)``,
        as :class:`~jaxcoll.dp.TokenBatches` does)."""
        return self.layout.batch_sharding

    def shard_batch(self, batch: PyTree, api: str = "Trainer.step") -> PyTree:
        """Place a global batch on the mesh, split along its leading axis; check its size.

        A host batch (NumPy) is whole on every process and split here; global ``jax.Array`` s
        placed as :attr:`batch_sharding` (each process gave only its rows, as
        :class:`~jaxcoll.dp.TokenBatches` does) are used as they are, others resharded."""
        self._check_batch(batch, api)
        to = self.batch_sharding
        return batch if placed_as(batch, to) else jax.device_put(batch, to)

    def _set_model_specs(self, found: list[P], params: PyTree) -> None:
        """Keep the params' model specs (:mod:`jaxcoll.dp.specs`) and prepare the strategy
        for them (new programs when they change; None when every leaf is whole over the
        model axes), and where this Trainer's state holds each leaf of ``params``."""
        model = tuple(found)
        tensor_split("Trainer.init", self.layout, found)
        if self._specs is None or model != self._specs.model:
            whole = all(s == P() for s in model)
            self.sync = self.sync.with_model_specs(None if whole else model)
            self._step_fns, self._eval_fn, self._placed = {}, None, None
        held = self.sync.named(self.sync.state_param_specs(params))
        self._specs = _Specs(model, tuple(jax.tree_util.tree_leaves(held)))

    def _check_placed(self, api: str, params: PyTree) -> None:
        """Raise if a leaf of ``params`` is placed over the mesh's model axes otherwise than
        this Trainer's model spec for it says, or over an axis with no role: the step
        would silently make it whole (or split it as the init's spec says).

        The model specs were found once, at init; a state placed as this Trainer places its
        own (the one a step returned, a copy of it, one restored into its template) carries
        them and is taken as it is. Only another placement is read again (its specs, to
        compare; a state's first arrival where no init ran: its specs, kept)."""
        known = self._specs
        leaves = jax.tree_util.tree_leaves(params)
        if known is not None and len(leaves) == len(known.held):
            if all(getattr(x, "sharding", None) == s for x, s in zip(leaves, known.held)):
                return
        found = model_specs(api, params, None, self.layout)
        if known is None:  # a state built elsewhere: take its specs
            if self.layout.expert_axis is not None:
                raise ValueError(
                    f"{api}: this Trainer's layout splits experts over the data axis "
                    f"{self.layout.expert_axis!r}, and a state's placement cannot tell them "
                    f"from the strategy's own split; call trainer.init first (or restore "
                    f"into the state it returns)."
                )
            self._set_model_specs(found, params)
            return
        # Whole over the model axes: any params (the model is the user's to change).
        model = known.model if any(s != P() for s in known.model) else (P(),) * len(found)
        check_placed_specs(api, params, found, [restrict(s, self.layout.axes) for s in model])
