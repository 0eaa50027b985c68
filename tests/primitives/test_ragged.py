"""ragged_all_to_all, all_gather_uneven, gather_uneven and reduce_scatter_uneven against the
NumPy oracle.

Every dtype (one pytree per call: all seven leaves share the sizes), group sizes 1, 2, 3, 4, 8
and a 2-D mesh, jitted and eager, with sizes that are negative, overflow the buffer, or do not
fit the receiver; reduce_scatter_uneven with every reduce op and parts of roughly even and of
very uneven sizes (its two lowerings); under pmap and vmap; gradients; what each platform
lowers to; every error. One program per (mesh, mode) computes every case.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll.primitives as C
from jaxcoll import distributed as dist
from tests.helpers import bind, mesh_1d, run_per_rank
from tests.primitives import oracle
from tests.primitives.test_collectives import (
    ALLOWED,
    CONFIGS,
    DTYPES,
    EAGER_DTYPES,
    RTOL,
    _config,
    make_inputs,
)

LABELS = ["n1", "n2", "n3", "n4", "n8", "2d-local"]
SMALL = ("n3", "n8")


def _sizes(n_dev: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    send = rng.integers(-1, 4, (n_dev, n)).astype(np.int32)
    send[0] = 3  # 3n rows: more than the buffer's m = 2n
    own = rng.integers(-1, 2 * n + 2, (n_dev,)).astype(np.int32)  # clipped to 0..2n
    own[0] = -1
    own[-1] = 2 * n + 1
    return send, own


@functools.cache
def _run(label: str, jit: bool):
    mesh, axis_name, groups = _config(label)
    n, n_dev = len(groups[0]), mesh.devices.size
    names = list(DTYPES)
    xs = {d: make_inputs(d, n_dev, n) for d in names}
    send, own = _sizes(n_dev, n, n_dev * 10 + n)

    def body(send, own, *leaves):
        tree = dict(zip(names, leaves))
        out = {}
        out["default"] = C.ragged_all_to_all(tree, axis_name, send)
        if label in SMALL:  # a receive capacity of 3 rows: most receivers drop rows
            out["small"] = C.ragged_all_to_all(tree, axis_name, send, out_size=3)
        out["all_gather_uneven"] = C.all_gather_uneven(tree, axis_name, own)
        out["gather_uneven"] = C.gather_uneven(tree, axis_name, own, dst=n - 1)
        return out

    got = run_per_rank(body, mesh, [send, own] + [xs[d] for d in names], jit=jit)
    return xs, send, own, got


def _expected(label, xs, send, own, tag, dname):
    _, _, groups = _config(label)
    n = len(groups[0])
    out = {}
    for members in groups:
        leaves = [xs[dname][d] for d in members]
        if tag == "all_gather_uneven":
            res = oracle.all_gather_uneven(leaves, [own[d] for d in members])
        elif tag == "gather_uneven":
            res = oracle.gather_uneven(leaves, [own[d] for d in members], n - 1)
        else:
            cap = {"default": 2 * n, "small": 3}[tag]
            res = oracle.ragged_all_to_all(leaves, [send[d] for d in members], cap)
        out.update(zip(members, res))
    return out


@pytest.mark.parametrize("label", LABELS)
def test_matches_numpy_oracle_for_every_dtype(label):
    """Jitted; the eager (plain) shard_map runs in the binding test below."""
    xs, send, own, got = _run(label, True)
    failures = []
    for tag in got:
        values, sizes = got[tag]
        for dname in values:
            for dev, (want, want_sizes) in _expected(label, xs, send, own, tag, dname).items():
                g = values[dname][dev]
                try:
                    assert g.dtype == xs[dname].dtype
                    np.testing.assert_array_equal(g, want)
                    np.testing.assert_array_equal(sizes[dev], want_sizes)
                except AssertionError as err:
                    failures.append(f"{tag} {dname} device {dev}: {err}")
    assert not failures, "\n".join(failures[:5])


def test_the_cases_exercise_clipping_and_dropping():
    """The random sizes above do hit every edge: negative sizes, sums past the buffer, rows
    that do not fit the receiver, and (for the gathers) sizes past the capacity."""
    xs, send, own, got = _run("n8", True)
    assert (send < 0).any() and (send.clip(0).sum(1) > 16).any()
    assert (own < 0).any() and (own > 16).any()
    unbounded = oracle.ragged_all_to_all(list(xs["int32"]), send, 16 * 8)
    offered = np.array([s.sum() for _, s in unbounded])
    kept = got["small"][1].sum(1)
    assert (kept < offered).any()  # receivers of 3 rows had to drop some
    np.testing.assert_array_equal(kept, np.minimum(offered, 3))


# ------------------------------------------------------------------ reduce_scatter_uneven
OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


def _rs_sizes(n: int) -> dict[str, list[int]]:
    """Parts of the 2n rows of make_inputs: "even" (n * max <= 2 * 2n: the padded
    reduce_scatter) and, from 3 ranks on, "skewed" (one long part: all_reduce and a slice)."""
    even = [2] * n
    if n >= 2:
        even[0], even[-1] = 3, 1
    if n >= 4:
        even[1], even[2] = 0, 4
    out = {"even": even}
    if n >= 3:
        out["skewed"] = [0] + [1] * (n - 2) + [n + 2]
    return out


@functools.cache
def _run_rs(label: str):
    """Every op the dtypes allow x both kinds of sizes, in one jitted program: one pytree per
    call (the dtypes that allow the op; the skewed sizes take one dtype of each kind, since
    the dtype rules are the collectives' own). Plain (eager) shard_map, pmap and vmap run in
    test_values_and_grad_under_every_binding."""
    mesh, axis_name, groups = _config(label)
    n, n_dev = len(groups[0]), mesh.devices.size
    names = list(DTYPES)
    xs = {d: make_inputs(d, n_dev, n) for d in names}

    def body(*leaves):
        tree = dict(zip(names, leaves))
        out = {}
        for op in OPS:
            for tag, sizes in _rs_sizes(n).items():
                allowed = {
                    d: v
                    for d, v in tree.items()
                    if op in ALLOWED[oracle.kind_of(DTYPES[d])]
                    and (tag == "even" or d in EAGER_DTYPES)
                }
                out[f"{op},{tag}"] = C.reduce_scatter_uneven(allowed, axis_name, sizes, op)
        return out

    return xs, run_per_rank(body, mesh, [xs[d] for d in names], jit=True)


@pytest.mark.parametrize("label", ["n1", "n3", "n8", "2d-both"])
def test_reduce_scatter_uneven_matches_numpy_oracle(label):
    """Every op x dtype x both kinds of sizes (both lowerings, from 3 ranks on), on 1, 3 and 8
    ranks and a tuple of two mesh axes; 2 ranks and an axis of a 2-D mesh (subgroups) run in
    tests/distributed/test_ragged.py (the sub2 and local groups)."""
    xs, got = _run_rs(label)
    _, _, groups = _config(label)
    n = len(groups[0])
    failures = []
    for key, (values, size) in got.items():
        op, tag = key.split(",")
        sizes = _rs_sizes(n)[tag]
        for dname, value in values.items():
            exact = oracle.kind_of(DTYPES[dname]) in ("bool", "integer") or op in ("min", "max")
            for members in groups:
                want = oracle.reduce_scatter_uneven([xs[dname][d] for d in members], op, sizes)
                for dev, (w, w_size) in zip(members, want):
                    g = value[dev]
                    try:
                        assert g.dtype == xs[dname].dtype and g.shape == w.shape, (
                            f"{g.dtype}{g.shape} != {xs[dname].dtype}{w.shape}"
                        )
                        if exact:
                            np.testing.assert_array_equal(g, w.astype(g.dtype))
                        else:
                            tol = RTOL[dname]
                            np.testing.assert_allclose(oracle.widen(g), w, rtol=tol, atol=tol)
                        assert size[dev] == w_size
                    except AssertionError as err:
                        failures.append(f"{key} {dname} device {dev}: {err}")
    assert len(got) == len(OPS) * len(_rs_sizes(n))
    assert not failures, "\n".join(failures[:5])


def _rs_collectives(sizes, op):
    mesh = mesh_1d(4)
    f = jax.jit(
        jax.shard_map(
            lambda v: C.reduce_scatter_uneven(v, "x", sizes, op)[0],
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )
    text = f.lower(
        jax.ShapeDtypeStruct((24, 2), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    ).as_text()
    return {
        k: text.count(f"stablehlo.{k}")
        for k in ("reduce_scatter", "all_reduce", "all_to_all", "all_gather")
    }


def test_reduce_scatter_uneven_takes_the_lowering_that_moves_fewer_bytes():
    """4 ranks, 6 rows: parts [2, 1, 3, 0] padded to 3 rows move 12 rows through one
    reduce-scatter, no more than an all-reduce of 6; [0, 1, 5, 0] would move 20: all-reduce."""
    none = {"reduce_scatter": 0, "all_reduce": 0, "all_to_all": 0, "all_gather": 0}
    assert _rs_collectives([2, 1, 3, 0], "sum") == {**none, "reduce_scatter": 1}
    assert _rs_collectives([2, 1, 3, 0], "max") == {**none, "all_to_all": 1}
    assert _rs_collectives([0, 1, 5, 0], "sum") == {**none, "all_reduce": 1}
    assert _rs_collectives([0, 1, 5, 0], "max") == {**none, "all_reduce": 1}


# ---------------------------------------------------------------- pmap, vmap, gradients
N = 4


def _bind(binding: str, body):
    return bind(binding, body, N, "i")


SEND = np.array([[1, 2, 0, 3], [0, 0, 4, 1], [2, 2, 2, 2], [5, 0, 0, 1]], np.int32)
OWN = np.array([3, 0, 6, 1], np.int32)
RS = {"rs_even": ([2, 1, 3, 0], "sum"), "rs_skewed": ([0, 1, 5, 0], "avg")}  # both lowerings


def _cases(x, send, own):
    return {
        "ragged": C.ragged_all_to_all(x, "i", send, out_size=7),
        "all_gather_uneven": C.all_gather_uneven(x, "i", own),
        "gather_uneven": C.gather_uneven(x, "i", own, dst=2),
        **{k: C.reduce_scatter_uneven(x, "i", sizes, op) for k, (sizes, op) in RS.items()},
    }


def _x():
    return np.random.default_rng(3).normal(size=(N, 6, 2)).astype(np.float32)


def _linear_reference(name):
    """The op as a gather from the stacked inputs, read off the oracle run on row ids (the
    reduce-scatters: a sum, or mean, over the ranks, sliced)."""
    if name in RS:
        sizes, op = RS[name]
        starts, cap = np.cumsum([0, *sizes]), max(sizes)

        def reduced(X):
            total = X.sum(0) / (N if op == "avg" else 1)
            return jnp.stack(
                [jnp.pad(total[a : a + k], ((0, cap - k), (0, 0))) for a, k in zip(starts, sizes)]
            )

        return reduced
    ids = [np.arange(1, 7)[:, None] + 6 * j for j in range(N)]  # id of row i of rank j, +1
    if name == "ragged":
        rows = [o for o, _ in oracle.ragged_all_to_all(ids, SEND, 7)]
    elif name == "all_gather_uneven":
        rows = [o for o, _ in oracle.all_gather_uneven(ids, OWN)]
    else:
        rows = [o for o, _ in oracle.gather_uneven(ids, OWN, 2)]
    index = np.stack(rows)[..., 0]

    def ref(X):
        flat = X.reshape(N * 6, 2)
        return jnp.where((index > 0)[..., None], flat[np.maximum(index - 1, 0)], 0.0)

    return ref


@pytest.mark.parametrize("binding", ["shard_map", "shard_map_jit", "pmap", "vmap", "vmap_jit"])
def test_values_and_grad_under_every_binding(binding):
    """Plain (eager) and jitted shard_map, pmap, vmap: the ops against the oracle; and
    (jitted and pmap) the gradient of a weighted sum of them against the same ops written as
    gathers (or sums) of the stacked inputs, computed in the same program."""
    x = _x()
    names = ("ragged", "all_gather_uneven", "gather_uneven", *RS)
    f = _bind(binding, _cases)
    rng = np.random.default_rng(4)
    w = {k: rng.normal(size=_linear_reference(k)(x).shape).astype(np.float32) for k in names}

    def both(X):
        def loss(X):
            out = f(X, SEND, OWN)
            return sum(jnp.sum(w[k] * out[k][0]) for k in names), out

        return jax.grad(loss, has_aux=True)(X)

    eager = binding in ("shard_map", "vmap")  # op by op: values only, the grad is jitted
    if eager:
        grad, got = None, f(x, SEND, OWN)
    else:
        grad, got = (jax.jit(both) if binding.endswith("_jit") else both)(x)
    xs = list(x)
    want = {
        "ragged": oracle.ragged_all_to_all(xs, SEND, 7),
        "all_gather_uneven": oracle.all_gather_uneven(xs, OWN),
        "gather_uneven": oracle.gather_uneven(xs, OWN, 2),
        **{k: oracle.reduce_scatter_uneven(xs, op, sizes) for k, (sizes, op) in RS.items()},
    }
    for name, rows in want.items():
        for r, (v, vs) in enumerate(rows):
            if name in RS:  # sums: the order of the additions may differ
                np.testing.assert_allclose(
                    np.asarray(got[name][0])[r], v, rtol=1e-6, atol=1e-6, err_msg=name
                )
            else:
                np.testing.assert_array_equal(np.asarray(got[name][0])[r], v, err_msg=name)
            np.testing.assert_array_equal(np.asarray(got[name][1])[r], vs, err_msg=name)
    if eager:
        return

    def reference_grad(keys):
        return jax.grad(lambda X: sum(jnp.sum(w[k] * _linear_reference(k)(X)) for k in keys))(x)

    np.testing.assert_allclose(grad, reference_grad(names), rtol=1e-6, atol=1e-6)
    moved = reference_grad(names[:3])  # the reduce-scatters read every row; these do not
    assert np.abs(moved).min() == 0 and np.abs(moved).max() > 0  # unsent rows: no grad


# ------------------------------------------------------------------------------ lowering
def _exported(platforms):
    mesh = mesh_1d(8)

    def body(x, s):
        tree = {"a": x, "b": x.astype(jnp.int32), "c": x > 0}
        return C.ragged_all_to_all(tree, "x", s[0])[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    args = (
        jax.ShapeDtypeStruct((64, 4), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
        jax.ShapeDtypeStruct((8, 8), jnp.int32, sharding=NamedSharding(mesh, P("x"))),
    )
    check = jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")
    text = jax.export.export(f, platforms=platforms, disabled_checks=[check])(*args).mlir_module()
    return {
        "ragged": text.count("custom_call @ragged_all_to_all"),
        "all_to_all": text.count("stablehlo.all_to_all"),
        "all_gather": len([1 for line in text.splitlines() if "stablehlo.all_gather" in line]),
    }


def test_gpu_gets_native_ragged_all_to_all_and_cpu_one_padded_all_to_all():
    # A pytree of three leaves moves in ONE transfer; the sizes in one small all_gather.
    assert _exported(("cuda",)) == {"ragged": 1, "all_to_all": 0, "all_gather": 1}
    assert _exported(("cpu",)) == {"ragged": 0, "all_to_all": 1, "all_gather": 1}


# -------------------------------------------------------------------------------- errors
def _trace(body, n=4):
    mesh = mesh_1d(n)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    f.trace(jax.ShapeDtypeStruct((n * 5, 3), jnp.float32, sharding=NamedSharding(mesh, P("x"))))


@pytest.mark.parametrize(
    "body, error, match",
    [
        (
            lambda x: C.ragged_all_to_all(x, "x", jnp.ones(3, jnp.int32))[0],
            ValueError,
            r"ragged_all_to_all: send_sizes has shape \(3,\), but it must have shape \(4,\)",
        ),
        (
            lambda x: C.ragged_all_to_all(x, "x", jnp.ones(4))[0],
            TypeError,
            r"ragged_all_to_all: send_sizes must hold integers, got dtype float32",
        ),
        (
            lambda x: C.ragged_all_to_all(x, "x", jnp.ones(4, jnp.int32), out_size=-1)[0],
            ValueError,
            r"ragged_all_to_all: out_size=-1 is negative",
        ),
        (
            lambda x: C.ragged_all_to_all(x, "x", jnp.ones(4, jnp.int32), out_size=2.0)[0],
            TypeError,
            r"ragged_all_to_all: out_size must be an int, got 2.0",
        ),
        (
            lambda x: C.ragged_all_to_all({"a": x, "b": x[:2]}, "x", jnp.ones(4, jnp.int32))[0][
                "a"
            ],
            ValueError,
            r"leading sizes 5 and 2; every leaf must hold the same number",
        ),
        (
            lambda x: C.ragged_all_to_all(x, "y", jnp.ones(4, jnp.int32))[0],
            ValueError,
            r"ragged_all_to_all: axis_name='y' is not bound here",
        ),
        (
            lambda x: C.all_gather_uneven(x[0, 0], "x", 1)[0][0],
            ValueError,
            r"all_gather_uneven: x holds a scalar",
        ),
        (
            lambda x: C.all_gather_uneven(x, "x", jnp.ones(2, jnp.int32))[0][0],
            ValueError,
            r"all_gather_uneven: size has shape \(2,\), but it must have shape \(\)",
        ),
        (
            lambda x: C.all_gather_uneven(x, "x", "3")[0][0],
            TypeError,
            r"all_gather_uneven: size must be an integer array, got '3'",
        ),
        (
            lambda x: C.gather_uneven(x, "x", 1, dst=4)[0][0],
            ValueError,
            r"gather_uneven: dst=4 is out of range for a group of 4 ranks \(0..3\)",
        ),
        (
            lambda x: C.reduce_scatter_uneven(x, "x", [1, 2, 2])[0],
            ValueError,
            r"reduce_scatter_uneven: sizes=\[1, 2, 2\] has 3 entries, but the group has 4 ranks. "
            r"Pass one size per rank",
        ),
        (
            lambda x: C.reduce_scatter_uneven(x, "x", [3, -1, 2, 1])[0],
            ValueError,
            r"reduce_scatter_uneven: sizes\[1\]=-1 is negative",
        ),
        (
            lambda x: C.reduce_scatter_uneven(x, "x", [1, 1, 1, 1])[0],
            ValueError,
            r"reduce_scatter_uneven: sizes=\[1, 1, 1, 1\] sums to 4, but x has 5 rows. Each rank's "
            r"input is the 4 parts concatenated",
        ),
        (
            lambda x: C.reduce_scatter_uneven(x, "x", jnp.ones(4, jnp.int32))[0],
            TypeError,
            r"reduce_scatter_uneven: sizes must be a list of 4 static ints.*cannot be traced",
        ),
        (
            lambda x: C.reduce_scatter_uneven(x, "x", [2.0, 1, 1, 1])[0],
            TypeError,
            r"reduce_scatter_uneven: sizes\[0\] must be an int, got 2.0",
        ),
        (
            lambda x: C.reduce_scatter_uneven(x.astype(jnp.int32), "x", [2, 1, 1, 1], "avg")[0],
            TypeError,
            r"reduce_scatter_uneven: op=ReduceOp.AVG is not defined for dtype int32",
        ),
        (
            lambda x: C.reduce_scatter_uneven(x, "x", [2, 1, 1, 1], "mode")[0],
            ValueError,
            r"reduce_scatter_uneven: op='mode' is not a reduce op",
        ),
        (
            lambda x: C.reduce_scatter_uneven(x[0, 0], "x", [0, 0, 0, 0])[0][None],
            ValueError,
            r"reduce_scatter_uneven: x holds a scalar",
        ),
        (
            lambda x: C.reduce_scatter_uneven(x, "y", [2, 1, 1, 1])[0],
            ValueError,
            r"reduce_scatter_uneven: axis_name='y' is not bound here",
        ),
    ],
)
def test_errors_name_the_op_the_argument_and_the_fix(body, error, match):
    with pytest.raises(error, match=match):
        _trace(body)


def test_a_group_that_is_not_its_axis_is_refused_clearly():
    g = dist.new_group([1, 5, 6])
    with pytest.raises(NotImplementedError, match="ragged_all_to_all: a group that is not"):
        _trace(lambda x: C.ragged_all_to_all(x, g, jnp.ones(3, jnp.int32))[0], n=8)
    with pytest.raises(NotImplementedError, match="reduce_scatter_uneven: a group that is not"):
        _trace(lambda x: C.reduce_scatter_uneven(x, g, [5, 0, 0])[0], n=8)
    # the world group is its axis: it runs the plain op
    w = dist.world()
    _trace(lambda x: C.all_gather_uneven(x, w, 2)[0][0], n=8)


assert set(LABELS) <= set(CONFIGS)
