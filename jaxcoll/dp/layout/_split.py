"""How the batch reaches each device: :class:`BatchSplit`, a bound layout's split of the
batch over its data axes (and of each sequence over its context axis)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..._core.context import local_part
from ..._core.typing import AxisName, PyTree


class BatchSplit(NamedTuple):
    """How the batch reaches each device: its examples split over ``axes`` (a mesh axis, a
    tuple of them, or () for none) into ``n`` parts, and, with a ``context`` axis of
    ``n_context`` devices, every array with a sequence axis (its second) split along it in
    the load-balanced layout (:mod:`jaxcoll._core.context`)."""

    axes: AxisName
    n: int = 1
    context: str | None = None
    n_context: int = 1

    @property
    def spec(self) -> P:
        """The batch's ``PartitionSpec`` as the step receives it (whole along the sequence:
        each device takes its part inside the step, no communication)."""
        return P(self.axes) if self.axes else P()

    def check(self, api: str, batch: PyTree, size: int, accum: int) -> None:
        """Raise ValueError, naming ``api``, if ``batch``'s ``size`` examples do not split
        evenly over the ``n`` parts times ``accum`` micro-batches, or a sequence over the
        context axis."""
        if self.context is not None:
            self._check_sequences(api, batch)
        unit = self.n * accum
        if size % unit:
            over = [f"{self.n} devices"] + [f"accum_steps={accum}"] * (accum != 1)
            why = "an uneven split would bias the gradient mean"
            fix = "Drop the short batch (dp.Batches(..., drop_last=True)) or use a batch size"
            raise ValueError(
                f"{api}: the global batch has {size} examples, which does not split evenly over "
                f"{' x '.join(over)} (a multiple of {unit} is needed); {why}. {fix} that is a "
                f"multiple of {unit}."
            )

    def _check_sequences(self, api: str, batch: PyTree) -> None:
        parts = 2 * self.n_context
        flat = jax.tree_util.tree_flatten_with_path(batch)[0]
        seqs = {jax.tree_util.keystr(p): np.shape(x)[1] for p, x in flat if np.ndim(x) >= 2}
        if len(set(seqs.values())) > 1:
            raise ValueError(
                f"{api}: with the context axis {self.context!r} every array of the batch "
                f"with two axes or more is a sequence along its second, split over that "
                f"axis; these differ in length: "
                + ", ".join(f"batch{k}: {v}" for k, v in seqs.items())
                + ". Give per-example features one axis (or as many positions as the "
                "sequence), or a layout without context."
            )
        for path, x in flat:
            if np.ndim(x) >= 2 and np.shape(x)[1] % parts:
                raise ValueError(
                    f"{api}: batch{jax.tree_util.keystr(path)} has a sequence of "
                    f"{np.shape(x)[1]} (its second axis), which does not split into "
                    f"{parts} equal chunks (2 for each of the {self.n_context} devices of "
                    f"the context axis {self.context!r}); use a sequence length that is a "
                    f"multiple of {parts}."
                )

    def part(self, batch: PyTree) -> PyTree:
        """Per device, inside ``shard_map``: this device's part of its batch."""
        context = self.context
        if context is None:
            return batch
        return jax.tree_util.tree_map(
            lambda x: local_part(x, context, self.n_context) if jnp.ndim(x) >= 2 else x, batch
        )
