"""The primitives that map to one lax collective compile to exactly that one collective.

Counted in the lowered StableHLO of a jitted shard_map on 8 devices: no hidden extra
communication (and, for the patterns, exactly the communication the docstrings promise).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from tests.helpers import mesh_1d

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "collective_broadcast",
)


def collective_counts(body, dtype=jnp.float32, n=8) -> dict[str, int]:
    mesh = mesh_1d(n)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.zeros((n * 16, 4), dtype), NamedSharding(mesh, P("x")))
    text = f.lower(x).as_text()
    counts = {c: len(re.findall(rf'stablehlo\.{c}"?[\s(]', text)) for c in COLLECTIVES}
    return {c: k for c, k in counts.items() if k}


@pytest.mark.parametrize(
    "name, body, expected",
    [
        ("all_reduce sum", lambda x: C.all_reduce(x, "x"), {"all_reduce": 1}),
        ("all_reduce avg", lambda x: C.all_reduce(x, "x", "avg"), {"all_reduce": 1}),
        ("all_reduce max", lambda x: C.all_reduce(x, "x", "max"), {"all_reduce": 1}),
        ("all_reduce min", lambda x: C.all_reduce(x, "x", "min"), {"all_reduce": 1}),
        ("all_gather", lambda x: C.all_gather(x, "x", tiled=True), {"all_gather": 1}),
        (
            "reduce_scatter sum",
            lambda x: C.reduce_scatter(x, "x", tiled=True),
            {"reduce_scatter": 1},
        ),
        ("all_to_all", lambda x: C.all_to_all(x, "x", tiled=True), {"all_to_all": 1}),
        ("shift", lambda x: C.shift(x, "x"), {"collective_permute": 1}),
        ("sendrecv", lambda x: C.sendrecv(x, "x", [(0, 5), (5, 0)]), {"collective_permute": 1}),
        ("scatter", lambda x: C.scatter(x, "x", 3, tiled=True), {"all_to_all": 1}),
        ("gather", lambda x: C.gather(x, "x", 2, tiled=True), {"all_gather": 1}),
        ("reduce", lambda x: C.reduce(x, "x", 2), {"all_reduce": 1}),
        # Patterns: exactly what the docstrings say, nothing else.
        (
            "broadcast (CPU: binomial tree)",
            lambda x: C.broadcast(x, "x", 3),
            {"collective_permute": 3},
        ),
        (
            "all_reduce product",
            lambda x: C.all_reduce(x, "x", "product"),
            {"all_to_all": 1, "all_gather": 1},
        ),
        (
            "reduce_scatter max",
            lambda x: C.reduce_scatter(x, "x", "max", tiled=True),
            {"all_to_all": 1},
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_collective_count(name, body, expected):
    assert collective_counts(body) == expected


def test_bitwise_on_ints_uses_the_pattern_and_bool_or_uses_pmax():
    assert collective_counts(lambda x: C.all_reduce(x, "x", "bxor"), jnp.int32) == {
        "all_to_all": 1,
        "all_gather": 1,
    }
    assert collective_counts(lambda x: C.all_reduce(x, "x", "bor"), jnp.bool_) == {"all_reduce": 1}


def test_counter_sees_a_second_collective():
    """The counter itself can fail: two psums are counted as two."""
    assert collective_counts(lambda x: C.all_reduce(C.all_reduce(x, "x"), "x")) == {"all_reduce": 2}


def test_broadcast_tree_steps_grow_with_log2_n():
    for n, steps in [(2, 1), (3, 2), (4, 2), (8, 3)]:
        counts = collective_counts(lambda x, n=n: C.broadcast(x, "x", n - 1), n=n)
        assert counts == {"collective_permute": steps}, (n, counts)


def test_inputs_unchanged_after_every_op():
    """NumPy and jax inputs are bit-identical after each primitive (results are new arrays)."""
    mesh = mesh_1d(4)
    ops = [
        lambda x: C.all_reduce(x, "x"),
        lambda x: C.all_reduce(x, "x", "product"),
        lambda x: C.reduce(x, "x", 1),
        lambda x: C.broadcast(x, "x", 2),
        lambda x: C.all_gather(x, "x"),
        lambda x: C.gather(x, "x", 0),
        lambda x: C.scatter(x, "x", 1, tiled=True),
        lambda x: C.reduce_scatter(x, "x", tiled=True),
        lambda x: C.reduce_scatter(x, "x", "min", tiled=True),
        lambda x: C.all_to_all(x, "x", tiled=True),
        lambda x: C.sendrecv(x, "x", [(0, 1)]),
        lambda x: C.shift(x, "x"),
    ]
    host = np.arange(4 * 8 * 2, dtype=np.float32).reshape(4 * 8, 2)
    snapshot = host.copy()
    dev = jax.device_put(host, NamedSharding(mesh, P("x")))
    for op in ops:
        f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        out = f(dev)
        jax.block_until_ready(out)
        np.testing.assert_array_equal(host, snapshot)
        np.testing.assert_array_equal(np.asarray(dev), snapshot)
