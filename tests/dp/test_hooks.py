"""dp.hooks: PowerSGD against single-device SGD and a NumPy PowerSGD run rank by rank, its
state through a checkpoint, a digits model trained through it, a user hook (the one in
jaxcoll/dp/hooks/base.py's docstring), and the errors.

Programs are shared through module fixtures: the whole file compiles six step programs.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcoll import dp
from jaxcoll.dp.hooks import PowerSGD, base
from tests.dp._models import MLP, batches, cross_entropy, max_rel_diff, oracle
from tests.helpers import mesh_1d

N = 8
LR = 0.1


def _same(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


# ------------------------------------------------- full rank: exactly plain SGD, scaling included
EXACT = PowerSGD(rank=32, start_iter=2, min_compression_rate=0)  # r = min(rows, cols) everywhere
K = 6


@pytest.fixture(scope="module")
def mlp_run():
    """K steps of the MLP (16-32-32-4) with full-rank PowerSGD, several buckets: the model,
    its start, the data, the params after ``start_iter`` steps, the initial and final state."""
    data = batches("mlp", K, 64)
    model = dp.Linen(MLP(), cross_entropy)
    params, model_state = model.init(jax.random.key(0), data[0])
    trainer = dp.Trainer(
        model, optax.sgd(LR), mesh=mesh_1d(N, "data"), sync=dp.sync.DDP(hook=EXACT, bucket_mb=0.002)
    )
    state = trainer.init(params, jax.random.key(1), model_state=model_state)
    first = jax.device_get(state)
    for s, batch in enumerate(data):
        state, _ = trainer.step(state, batch)
        if s + 1 == EXACT.start_iter:
            before = jax.device_get(state.params)
    return model, params, model_state, data, before, first, jax.device_get(state)


def test_powersgd_before_start_iter_is_plain_ddp_bit_for_bit(mlp_run):
    model, params, model_state, data, before, _, _ = mlp_run
    trainer = dp.Trainer(
        model, optax.sgd(LR), mesh=mesh_1d(N, "data"), sync=dp.sync.DDP(bucket_mb=0.002)
    )
    state = trainer.init(params, jax.random.key(1), model_state=model_state)
    for batch in data[: EXACT.start_iter]:
        state, _ = trainer.step(state, batch)
    assert _same(before, state.params)


def test_powersgd_at_full_rank_equals_single_device_sgd(mlp_run):
    # SGD's params are linear in the gradient: a mean off by any factor (n: Q not divided by
    # n) fails this, which Adam would hide.
    model, params, model_state, data, _, first, last = mlp_run
    want, _ = oracle(model, optax.sgd(LR), params, model_state, data)
    assert max_rel_diff(last.params, want) < 1e-5
    # Compression ran: each Q is now M^T P / n, no longer the initial random draw.
    assert len(first.comm_state) > 1  # several buckets, each with its own state
    for a, b in zip(
        jax.tree_util.tree_leaves([s["q"] for s in first.comm_state if s]),
        jax.tree_util.tree_leaves([s["q"] for s in last.comm_state if s]),
        strict=True,
    ):
        assert not np.allclose(a, b)


# ------------------------------------------- low rank: a NumPy PowerSGD, rank by rank, and resume
LOW = PowerSGD(rank=2, start_iter=2, min_compression_rate=0)
LOW_RING = dp.sync.DDP(hook=LOW, algorithm="ring")


def _loss(p, batch, rng):
    pred = batch["x"] @ p["w1"] @ p["w2"] + p["b"]
    return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, -1)), {}


def _params():
    rng = np.random.default_rng(0)
    return {
        "b": np.zeros(3, np.float32),
        "w1": rng.normal(size=(6, 5)).astype(np.float32),
        "w2": rng.normal(size=(5, 3)).astype(np.float32) * 0.3,
    }


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 3)) + 0.1 * rng.normal(size=(256, 3))).astype(np.float32)
    return dp.Batches({"x": x, "y": y}, 32, seed=2)


@pytest.fixture(scope="module")
def low_trainer():
    # algorithm="ring": the bucket's sums go through jaxcoll's packed all-reduce.
    return dp.Trainer(_loss, optax.sgd(LR), mesh=mesh_1d(N, "data"), sync=LOW_RING)


def _local_grads(p, batch):
    """Each rank's gradient of its own share of the batch, in float64: (rank, ...) arrays."""
    x = np.asarray(batch["x"], np.float64).reshape(N, -1, 6)
    y = np.asarray(batch["y"], np.float64).reshape(N, -1, 3)
    h = x @ p["w1"]
    d = 2 * (h @ p["w2"] + p["b"] - y) / x.shape[1]
    return {
        "b": d.sum(1),
        "w1": np.swapaxes(x, 1, 2) @ (d @ p["w2"].T),
        "w2": np.swapaxes(h, 1, 2) @ d,
    }


def _gram_schmidt(m):
    """torch's ``_orthogonalize`` (epsilon 0), in float64."""
    m = m.copy()
    for i in range(m.shape[1]):
        m[:, i] /= np.linalg.norm(m[:, i])
        m[:, i + 1 :] -= np.outer(m[:, i], m[:, i] @ m[:, i + 1 :])
    return m


def _numpy_powersgd(params, q0, data, steps):
    """torch's powerSGD_hook, rank by rank, in float64: the params, each rank's errors and
    the Q factors after ``steps`` SGD steps (one bucket: w2, w1 compressed; b not)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    names = ["w2", "w1"]  # the bucket's compressed tensors, in DDP's order
    q = [np.asarray(v, np.float64) for v in q0]
    err = {k: np.zeros((N, *p[k].shape)) for k in names}
    for s in range(steps):
        g = _local_grads(p, data[s])
        mean = {k: v.mean(0) for k, v in g.items()}
        if s >= LOW.start_iter:
            for j, k in enumerate(names):
                m = g[k] + err[k]  # (rank, rows, cols): each rank's input
                ps = _gram_schmidt(sum(m[r] @ _gram_schmidt(q[j]) for r in range(N)))
                q[j] = sum(m[r].T @ ps for r in range(N)) / N
                mean[k] = ps @ q[j].T
                err[k] = m - mean[k]
        p = {k: p[k] - LR * mean[k] for k in p}
    return p, [err[k] for k in names], q


def test_powersgd_matches_numpy_powersgd_rank_by_rank(low_trainer):
    state = low_trainer.init(_params(), jax.random.key(0))
    assert jax.tree_util.tree_structure(state.comm_state) == jax.tree_util.tree_structure(
        [{"error": [0, 0], "q": [0, 0]}]
    )
    q0 = [np.asarray(q)[0] for q in state.comm_state[0]["q"]]
    for q in state.comm_state[0]["q"]:  # the initial Q: the same on every rank
        assert np.array_equal(np.asarray(q), np.broadcast_to(np.asarray(q)[:1], q.shape))
    data, steps = _data(), 4
    for s in range(steps):
        state, _ = low_trainer.step(state, data[s])
    want, errors, qs = _numpy_powersgd(_params(), q0, data, steps)

    for k in want:
        np.testing.assert_allclose(state.params[k], want[k], rtol=1e-5, atol=1e-5)
    for got, err in zip(state.comm_state[0]["error"], errors, strict=True):
        got = np.asarray(got)  # (rank, ...): each rank's own error
        np.testing.assert_allclose(got, err, rtol=1e-4, atol=1e-5)
        assert np.abs(got[0] - got[1]).max() > 1e-2  # local: different on every rank
    for got, q in zip(state.comm_state[0]["q"], qs, strict=True):
        got = np.asarray(got)
        assert np.array_equal(got, np.broadcast_to(got[:1], got.shape))  # equal everywhere
        sign = np.sign(np.sum(got[0] * q, axis=0))  # QR and Gram-Schmidt differ in sign only
        np.testing.assert_allclose(got[0] * sign, q, rtol=1e-4, atol=1e-5)


def test_powersgd_state_resumes_bit_identically_from_a_checkpoint(low_trainer, tmp_path):
    data = _data()
    fresh = lambda trainer: trainer.init(_params(), jax.random.key(0))  # noqa: E731
    ref, _ = low_trainer.fit(fresh(low_trainer), data, steps=8)  # never stopped
    low_trainer.fit(
        fresh(low_trainer), data, steps=4, checkpoint=dp.Checkpointer(tmp_path, every=4)
    )
    # A new process would build a new Trainer: its state comes from the checkpoint at step 4.
    again = dp.Trainer(_loss, optax.sgd(LR), mesh=mesh_1d(N, "data"), sync=LOW_RING)
    resumed, hist = again.fit(
        fresh(again), data, steps=8, checkpoint=dp.Checkpointer(tmp_path, every=4)
    )
    assert [h["step"] for h in hist] == [5, 6, 7, 8]
    assert _same(resumed.params, ref.params)
    assert _same(resumed.comm_state, ref.comm_state)
    assert _same(resumed, ref)
    assert np.abs(np.asarray(ref.comm_state[0]["error"][0])).max() > 0  # compression ran


@pytest.mark.parametrize(
    "warm_start, use_error_feedback", [(True, True), (False, True), (True, False), (False, False)]
)
def test_powersgd_sums_the_rest_the_ps_and_the_qs_in_one_collective_each(
    warm_start, use_error_feedback
):
    shapes = [(5, 3), (3,), (6, 5), (4,)]
    hook = PowerSGD(
        rank=2,
        start_iter=0,
        min_compression_rate=0,
        warm_start=warm_start,
        use_error_feedback=use_error_feedback,
    )
    state = hook.init([jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes], 0)
    assert sorted(state or {}) == ["error"] * use_error_feedback + ["q"] * warm_start
    calls = []

    class Recorded(base.Bucket):
        def sum(self, arrays):
            calls.append([a.shape for a in arrays])
            return super().sum(arrays)

    def body(*grads):
        own = jax.tree_util.tree_map(lambda x: jax.lax.pcast(x, "data", to="varying"), state)
        bucket = Recorded(
            tuple(g[0] for g in grads), 0, "data", N, "native", jnp.zeros((), jnp.int32)
        )
        return hook(own, bucket)[0]

    fn = jax.shard_map(body, mesh=mesh_1d(N, "data"), in_specs=P("data"), out_specs=P())
    jax.make_jaxpr(fn)(*[jnp.zeros((N, *s)) for s in shapes])
    # the vectors, the P of each matrix, the Q of each matrix (rows x 2, cols x 2)
    assert calls == [[(3,), (4,)], [(5, 2), (6, 2)], [(3, 2), (5, 2)]]


# ------------------------------------------------------------------- accuracy: sklearn digits
STEPS_DIGITS = 150


class Digits(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))


def test_powersgd_rank4_trains_digits_above_95_percent():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    n_test = len(y_te) // N * N
    train = dp.Batches({"x": x_tr, "y": y_tr}, 128, seed=0)
    model = dp.Linen(Digits(), cross_entropy)
    hook = PowerSGD(rank=4, start_iter=20)  # both kernels compressed (64x128, 128x10)
    assert hook.ranks(
        [jax.ShapeDtypeStruct((64, 128), jnp.float32), jax.ShapeDtypeStruct((128, 10), jnp.float32)]
    ) == [4, 4]
    trainer = dp.Trainer(
        model, optax.adam(3e-3), mesh=mesh_1d(N, "data"), sync=dp.sync.DDP(hook=hook)
    )
    params, model_state = model.init(jax.random.key(0), train[0])
    state = trainer.init(params, jax.random.key(1), model_state=model_state)
    evaluate = dp.Evaluate([{"x": x_te[:n_test], "y": y_te[:n_test]}])
    state, hist = trainer.fit(state, train, steps=STEPS_DIGITS, callbacks=[evaluate])
    assert hist[-1]["eval_accuracy"] > 0.95, hist[-1]


# --------------------------------------------------------------- a user hook: base.py's example
def _docstring_example() -> str:
    doc = base.__doc__
    code = doc[doc.index("arrives typed varying (one copy per rank)::") :]
    code = code[code.index("\n\n") + 2 : code.index("\n\n``tests/dp/test_hooks.py``")]
    return "\n".join(line[4:] for line in code.splitlines())


def test_user_hook_from_the_docstring_counts_nonfinite_means():
    namespace = {"dp": dp, "optax": optax, "loss_fn": _loss}
    exec(_docstring_example(), namespace)
    hook = namespace["trainer"].sync.hook
    assert type(hook).__name__ == "CountNonFinite"
    assert isinstance(hook, dp.hooks.StatefulHook)  # the typed interface: __call__ and init
    trainer = dp.Trainer(
        _loss, optax.sgd(LR), mesh=mesh_1d(N, "data"), sync=dp.sync.DDP(hook=hook, bucket_mb=None)
    )  # a bucket per leaf
    state = trainer.init(_params(), jax.random.key(0))
    data = _data()
    for s in range(2):
        state, _ = trainer.step(state, data[s])
    # The mean is DDP's: two plain SGD steps of the NumPy reference.
    want, _, _ = _numpy_powersgd(_params(), [], data, 2)
    for k in want:
        np.testing.assert_allclose(state.params[k], want[k], rtol=1e-5, atol=1e-6)
    assert [np.asarray(c).tolist() for c in state.comm_state] == [[0] * N] * 3
    bad = {"x": data[2]["x"].copy(), "y": data[2]["y"]}
    bad["x"][0, 0] = np.nan
    state, _ = trainer.step(state, bad)
    assert [np.asarray(c).tolist() for c in state.comm_state] == [[1] * N] * 3


# ------------------------------------------------------------------------------------ errors
def test_a_hook_returning_a_wrong_shape_is_named():
    def bad(state, bucket):
        return [g[:1] for g in bucket.grads], state

    trainer = dp.Trainer(_loss, optax.sgd(LR), mesh=mesh_1d(N, "data"), sync=dp.sync.DDP(hook=bad))
    state = trainer.init(_params(), jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"returned a gradient of float32\[1, 3\] for one of "
        r"float32\[5, 3\]; it must return each gradient's mean",
    ):
        trainer.step(state, _data()[0])


def test_powersgd_with_a_sharded_strategy_is_refused():
    with pytest.raises(
        ValueError,
        match=r"dp\.sync\.ZeRO1: hook=PowerSGD\(rank=4.*cannot be "
        r"used with a sharded strategy",
    ):
        dp.sync.ZeRO1(hook=PowerSGD(rank=4))
    with pytest.raises(ValueError, match=r"dp\.sync\.FSDP: hook=PowerSGD"):
        dp.sync.FSDP(hook=PowerSGD(rank=4))
    assert isinstance(PowerSGD(rank=4), dp.hooks.PhasedHook)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"rank": 0}, ValueError, r"rank=0 must be at least 1 \(a rank of 1, 2 or 4 is typical\)"),
        ({"start_iter": -1}, ValueError, r"start_iter=-1 must be at least 0"),
        ({"min_compression_rate": -1.0}, ValueError, r"min_compression_rate=-1.0 is out of range"),
        ({"min_compression_rate": float("nan")}, ValueError, r"min_compression_rate=nan"),
        ({"rank": 2.0}, TypeError, r"rank must be an int \(.*\), got 2.0 of type float"),
        ({"warm_start": 1}, TypeError, r"warm_start must be True or False, got 1"),
        ({"seed": "0"}, TypeError, r"seed must be an int"),
    ],
)
def test_powersgd_arguments_are_checked(kwargs, error, message):
    with pytest.raises(error, match=r"dp\.hooks\.PowerSGD: " + message):
        PowerSGD(**kwargs)


def test_powersgd_plan_follows_torchs_rule():
    hook = PowerSGD(rank=4)  # min_compression_rate 2: 4 * (rows + cols) * 2 < rows * cols
    shapes = [(64,), (32, 16), (17, 16), (16, 16), (3, 3, 8, 16), (1, 40)]
    structs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    # (3, 3, 8, 16) is the 72 x 16 matrix; (1, 40) has r = 1 and saves 40 / 41 < 2.
    assert hook.ranks(structs) == [0, 4, 4, 0, 4, 0]
    state = hook.init(structs, 3)
    assert [q.shape for q in state["q"]] == [(16, 4), (16, 4), (16, 4)]
    assert [e.shape for e in state["error"]] == [(32, 16), (17, 16), (3, 3, 8, 16)]
    assert PowerSGD(use_error_feedback=False, warm_start=False).init(structs, 0) == ()
    assert PowerSGD(rank=4).init(structs[:1], 0) == ()  # nothing compressed: stateless


def test_powersgd_switches_program_at_start_iter_with_no_cond_inside(mlp_run):
    # The Trainer compiles one program per phase (exact, compressed) and picks it on the
    # host: no lax.cond in either (on XLA:CPU a cond copies every gradient into its branch).
    model, params, model_state, data, _, _, _ = mlp_run
    trainer = dp.Trainer(
        model, optax.sgd(LR), mesh=mesh_1d(N, "data"), sync=dp.sync.DDP(hook=EXACT, bucket_mb=0.002)
    )
    state = trainer.init(params, jax.random.key(1), model_state=model_state)
    kinds = []
    for batch in data[: EXACT.start_iter + 1]:
        step, args = trainer.step_program(state, batch)
        text = str(jax.make_jaxpr(step)(*args))
        kinds.append((" cond[" in text, text.count("householder_product") > 0 or "qr" in text))
        state, _ = trainer.step(state, batch)
    assert len(trainer._step_fns) == 2
    assert not any(c for c, _ in kinds), kinds
    assert [q for _, q in kinds] == [False] * EXACT.start_iter + [True], kinds
