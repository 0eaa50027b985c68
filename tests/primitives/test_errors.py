"""Every bad input raises at trace time with the op, the argument, the value and the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from jaxcoll import ReduceOp
from tests.helpers import mesh_1d


def trace(body, n=4, shape=(8, 3), dtype=jnp.float32):
    """Trace (not run) ``body`` under a jitted shard_map over n devices."""
    mesh = mesh_1d(n)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.zeros((n * shape[0],) + shape[1:], dtype), NamedSharding(mesh, P("x")))
    return f.lower(x)


@pytest.mark.parametrize(
    "body, match",
    [
        (
            lambda x: C.broadcast(x, "x", 4),
            r"broadcast: src=4 is out of range for a group of 4 "
            r"ranks \(0\.\.3\)",
        ),
        (lambda x: C.broadcast(x, "x", -1), r"broadcast: src=-1 is out of range"),
        (lambda x: C.reduce(x, "x", 9), r"reduce: dst=9 is out of range for a group of 4"),
        (lambda x: C.gather(x, "x", 4), r"gather: dst=4 is out of range"),
        (lambda x: C.scatter(x, "x", 7, tiled=True), r"scatter: src=7 is out of range"),
        (lambda x: C.sendrecv(x, "x", [(0, 4)]), r"sendrecv: pairs dst=4 is out of range"),
        (
            lambda x: C.sendrecv(x, "x", [(0, 1), (0, 2)]),
            r"sendrecv: pairs=.* is not a partial permutation: rank 0 sends more than once",
        ),
        (
            lambda x: C.sendrecv(x, "x", [(0, 2), (1, 2)]),
            r"not a partial permutation: rank 2 receives more than once",
        ),
        (lambda x: C.all_reduce(x, "x", "median"), r"all_reduce: op='median' is not a reduce op"),
        (lambda x: C.reduce_scatter(x, "x", "mean_of_squares"), r"reduce_scatter: op="),
        (
            lambda x: C.scatter(x[:6], "x", 0, tiled=True),
            r"scatter: x.shape\[0\] has size 6, which is not divisible by the group size 4",
        ),
        (
            lambda x: C.scatter(x, "x", 0),
            r"scatter: x.shape\[0\] has size 8 but the group has 4 ranks.*tiled=True",
        ),
        (
            lambda x: C.reduce_scatter(x[:6], "x", tiled=True),
            r"reduce_scatter: x.shape\[0\] has size 6, which is not divisible by the group size 4",
        ),
        (
            lambda x: C.reduce_scatter(x, "x"),
            r"reduce_scatter: x.shape\[0\] has size 8 but the "
            r"group has 4 ranks",
        ),
        (
            lambda x: C.all_to_all(x, "x", 1, 0, tiled=True),
            r"all_to_all: x.shape\[1\] \(split_dim\) has size 3, which is not divisible by the "
            r"group size 4",
        ),
        (
            lambda x: C.all_to_all(x, "x", 3, 0),
            r"all_to_all: split_dim=3 is out of range for an "
            r"array of rank 2",
        ),
        (lambda x: C.all_gather(x, "x", dim=5), r"all_gather: dim=5 is out of range"),
        (
            lambda x: C.all_reduce(x, "y"),
            r"all_reduce: axis_name='y' is not bound here. Call it inside jax.shard_map over a "
            r"mesh with axis 'y'",
        ),
        (lambda x: C.all_reduce(x, ()), r"all_reduce: axis_name=\(\) names no mesh axis"),
        (lambda x: C.shift(x, "x", 1.5), r"shift: offset must be an int, got 1.5"),
    ],
)
def test_bad_values_raise_value_error(body, match):
    with pytest.raises((ValueError, TypeError), match=match) as info:
        trace(body)
    if "must be an int" not in match:
        assert info.type is ValueError


@pytest.mark.parametrize(
    "op, dtype, match",
    [
        (
            "max",
            jnp.complex64,
            r"op=ReduceOp.MAX is not defined for dtype complex64.*SUM, AVG, "
            r"PRODUCT",
        ),
        ("min", jnp.complex64, r"op=ReduceOp.MIN is not defined for dtype complex64"),
        ("avg", jnp.int32, r"op=ReduceOp.AVG is not defined for dtype int32.*cast to a floating"),
        ("avg", jnp.bool_, r"op=ReduceOp.AVG is not defined for dtype bool"),
        ("bxor", jnp.float32, r"op=ReduceOp.BXOR is not defined for dtype float32"),
        ("band", jnp.bfloat16, r"op=ReduceOp.BAND is not defined for dtype bfloat16"),
        ("bor", jnp.complex64, r"op=ReduceOp.BOR is not defined for dtype complex64"),
    ],
)
def test_op_not_defined_for_dtype_raises_type_error(op, dtype, match):
    with pytest.raises(TypeError, match="all_reduce: " + match):
        trace(lambda x: C.all_reduce(x, "x", op), dtype=dtype)
    with pytest.raises(TypeError, match="reduce_scatter: " + match):
        trace(lambda x: C.reduce_scatter(x, "x", op, tiled=True), dtype=dtype)
    with pytest.raises(TypeError, match="reduce: " + match):
        trace(lambda x: C.reduce(x, "x", 0, op), dtype=dtype)


def test_outside_shard_map_names_the_fix():
    with pytest.raises(
        ValueError,
        match=r"broadcast: axis_name='x' is not bound here. Call it "
        r"inside jax.shard_map over a mesh with axis 'x'",
    ):
        C.broadcast(jnp.ones(3), "x", 0)
    with pytest.raises(ValueError, match=r"world_size: axis_name=\('a', 'b'\) is not bound"):
        C.world_size(("a", "b"))


def test_traced_rank_is_a_type_error():
    def body(x):
        src = jnp.argmax(x[:, 0])  # a traced value, not a static int
        return C.broadcast(x, "x", src)

    with pytest.raises(
        TypeError,
        match=r"broadcast: src must be a static Python int known at "
        r"trace time, got a traced value",
    ):
        trace(body)


def test_wrong_types_are_type_errors():
    with pytest.raises(TypeError, match=r"all_reduce: op must be a jaxcoll.ReduceOp or its name"):
        trace(lambda x: C.all_reduce(x, "x", 3))
    with pytest.raises(
        TypeError,
        match=r"all_gather: leaf 1 of x must be an array or a number, "
        r"got str instead",
    ):
        trace(lambda x: C.all_gather([x, "text"], "x"))
    with pytest.raises(TypeError, match=r"sendrecv: pairs must be a sequence of \(src, dst\)"):
        trace(lambda x: C.sendrecv(x, "x", "0->1"))
    with pytest.raises(TypeError, match=r"broadcast: src must be an int, got True"):
        trace(lambda x: C.broadcast(x, "x", True))


def test_reduce_op_accepts_names_and_rejects_unknown():
    assert ReduceOp("MAX") is ReduceOp.MAX
    assert ReduceOp("prod") is ReduceOp.PRODUCT
    assert ReduceOp.SUM == "sum"
    with pytest.raises(ValueError):
        ReduceOp("median")
