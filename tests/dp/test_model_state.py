"""Model state (BatchNorm statistics) stays identical on every device, for every algorithm.

A plain ``nn.BatchNorm`` (no axis_name) computes running statistics from each rank's own
examples; the Trainer averages them over the data axis every step, so every device holds the
same bits after any number of steps, whatever algorithm synchronises the gradients.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from jaxcoll import dp
from tests.dp._models import CNN, batches, cross_entropy
from tests.helpers import mesh_1d, mesh_2d

K = 3


def _copies(tree):
    """Each device's copy of every leaf, from the output's addressable shards."""
    return [
        [np.asarray(s.data) for s in leaf.addressable_shards]
        for leaf in jax.tree_util.tree_leaves(tree)
    ]


@pytest.mark.parametrize("algorithm", ["native", "ring", "tree", "auto", "hierarchical"])
def test_plain_batchnorm_stats_are_bit_identical_on_every_device(algorithm):
    if algorithm == "hierarchical":
        mesh, axis = mesh_2d(2, 4), ("node", "local")
    else:
        mesh, axis = mesh_1d(8, "data"), "data"
    layout = dp.Layout(replicate=axis)
    model = dp.Linen(CNN(None), cross_entropy)  # plain BatchNorm: per-rank statistics
    data = batches("cnn", K, 32)
    params, ms = model.init(jax.random.key(0), data[0])
    trainer = dp.Trainer(
        model, optax.adam(1e-2), mesh=mesh, layout=layout, sync=dp.sync.DDP(algorithm=algorithm)
    )
    state = trainer.init(params, jax.random.key(1), model_state=ms)
    for batch in data:
        state, _ = trainer.step(state, batch)
    stats = _copies(state.model_state["batch_stats"])
    assert len(stats) == 2 and all(len(copies) == 8 for copies in stats)  # mean, var
    for copies in stats:
        different = [d for d, c in enumerate(copies) if not np.array_equal(c, copies[0])]
        assert different == [], (
            algorithm,
            "devices whose running stats differ from 0's",
            different,
            float(np.max(np.abs(copies[-1] - copies[0]))),
        )
    for copies in _copies(state.params):
        assert all(np.array_equal(c, copies[0]) for c in copies)
    # The stats trained (moved off their init), so equal copies are not trivially equal.
    for copies, init in zip(stats, jax.tree_util.tree_leaves(ms["batch_stats"]), strict=True):
        assert np.max(np.abs(copies[0] - np.asarray(init))) > 1e-4
