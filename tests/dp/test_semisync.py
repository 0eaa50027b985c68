"""dp.sync.DiLoCo and dp.sync.LocalSGD: semi-synchronous training against a NumPy reference of
the algorithm, against DDP where they coincide, and the bytes that cross replicas per step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcoll import dp

IN, WIDTH, BATCH = 4, 16, 16
LAYOUT = dp.Layout(replicate=("node", "local"))  # 2 replicas (node) of 4 devices (local)


def _mesh():
    return jax.make_mesh((2, 4), ("node", "local"))


def _params(seed=0):
    r = np.random.default_rng(seed)
    return {
        "w1": (r.normal(size=(IN, WIDTH)) / 2).astype(np.float32),
        "b1": np.zeros(WIDTH, np.float32),
        "w2": (r.normal(size=(WIDTH, 1)) / 4).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def _batches(steps, seed=1):
    r = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = r.normal(size=(BATCH, IN)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x.sum(1, keepdims=True)).astype(np.float32)})
    return out


def loss_fn(p, batch, rng):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2), {}


# ----------------------------------------------------------------------------- NumPy oracle
def np_grads(p, x, y):
    """The gradient of the mean squared error of the MLP on rows ``x``, by hand."""
    h = np.tanh(x @ p["w1"] + p["b1"])
    d_out = 2 * (h @ p["w2"] + p["b2"] - y) / len(x)
    dz = (d_out @ p["w2"].T) * (1 - h**2)
    return {"w1": x.T @ dz, "b1": dz.sum(0), "w2": h.T @ d_out, "b2": d_out.sum(0)}


def np_adam(lr, b1=0.9, b2=0.999, eps=1e-8):
    def init(p):
        return {
            "m": {k: 0 * v for k, v in p.items()},
            "v": {k: 0 * v for k, v in p.items()},
            "t": 0,
        }

    def step(p, g, s):
        t = s["t"] + 1
        m = {k: b1 * s["m"][k] + (1 - b1) * g[k] for k in p}
        v = {k: b2 * s["v"][k] + (1 - b2) * g[k] ** 2 for k in p}
        new = {k: p[k] - lr * (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps) for k in p}
        return new, {"m": m, "v": v, "t": t}

    return init, step


def np_diloco(
    params, batches, replicas, every, inner_lr, outer_lr, momentum, groups=None, mixing=0
):
    """DiLoCo as its paper writes it: per replica Adam on its rows, Nesterov outer steps. With
    ``groups`` (lists of param names), Streaming DiLoCo: group p meets where
    ``(step + 1 + p * every // len(groups)) % every == 0``, replicas keeping ``mixing``."""
    init, inner_step = np_adam(inner_lr)
    groups = groups or [sorted(params)]
    glob = {k: v.astype(np.float64) for k, v in params.items()}
    local = [dict(glob) for _ in range(replicas)]
    states = [init(glob) for _ in range(replicas)]
    trace = {k: 0 * v for k, v in glob.items()}
    for step, b in enumerate(batches):
        rows = len(b["x"]) // replicas
        for r in range(replicas):  # replica r: its block of rows of the global batch
            part = slice(r * rows, (r + 1) * rows)
            g = np_grads(local[r], b["x"][part].astype(np.float64), b["y"][part])
            local[r], states[r] = inner_step(local[r], g, states[r])
        local = [dict(loc) for loc in local]
        for p, keys in enumerate(groups):
            if (step + 1 + p * every // len(groups)) % every:
                continue
            for k in keys:
                delta = glob[k] - np.mean([loc[k] for loc in local], 0)
                trace[k] = delta + momentum * trace[k]
                glob[k] = glob[k] - outer_lr * (delta + momentum * trace[k])
                for loc in local:
                    loc[k] = mixing * loc[k] + (1 - mixing) * glob[k]
    return glob


def _train(sync, optimizer, batches, layout=LAYOUT):
    mesh = _mesh() if layout is LAYOUT else None  # a layout by degrees builds its own
    trainer = dp.Trainer(loss_fn, optimizer, mesh=mesh, layout=layout, sync=sync)
    state = trainer.init(_params(), jax.random.key(0))
    for b in batches:
        state, _ = trainer.step(state, b)
    return trainer, state


# ---------------------------------------------------------------------------------- tests
def test_diloco_equals_the_numpy_reference():
    batches = _batches(20)
    sync = dp.sync.DiLoCo(every=4, outer=optax.sgd(0.7, momentum=0.9, nesterov=True))
    _, state = _train(sync, optax.adam(1e-2), batches)
    want = np_diloco(_params(), batches, 2, 4, 1e-2, 0.7, 0.9)
    got = jax.device_get(state.params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, err_msg=k)
    # every replica starts the next interval from the global params (step 20 is a sync)
    local = jax.device_get(state.opt_state.local)
    for k in want:
        np.testing.assert_array_equal(local[k], np.stack([got[k]] * 2))
    # and the run moved: the reference is not the initial params
    assert max(np.abs(want[k] - _params()[k]).max() for k in want) > 1e-2


def test_streaming_diloco_equals_the_numpy_reference():
    batches = _batches(12, seed=5)
    sync = dp.sync.StreamingDiLoCo(
        every=4, fragments=2, mixing=0.25, outer=optax.sgd(0.7, momentum=0.9, nesterov=True)
    )
    _, state = _train(sync, optax.adam(1e-2), batches)
    # leaves b1 (16), b2 (1), w1 (64), w2 (16): middles 8, 16.5, 49, 89 of 97 -> 0, 0, 1, 1
    groups = [["b1", "b2"], ["w1", "w2"]]
    want = np_diloco(_params(), batches, 2, 4, 1e-2, 0.7, 0.9, groups, 0.25)
    got = jax.device_get(state.params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, err_msg=k)
    assert len(state.opt_state.outer) == 2


@pytest.mark.parametrize(
    "sync, layout",
    [
        (dp.sync.LocalSGD(every=1), LAYOUT),  # 2 replicas of 4 devices
        (dp.sync.DiLoCo(every=1, outer=optax.sgd(1.0)), dp.Layout(replicate=8)),  # 8 of 1
    ],
    ids=["LocalSGD-2x4", "DiLoCo-8x1"],
)
def test_every_step_averaging_is_ddp(sync, layout):
    batches = _batches(3, seed=2)
    optimizer = optax.sgd(0.1, momentum=0.9)
    _, ddp = _train(dp.sync.DDP(), optimizer, batches, layout)
    _, semi = _train(sync, optimizer, batches, layout)
    want, got = jax.device_get(ddp.params), jax.device_get(semi.params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, err_msg=k)
    assert max(np.abs(want[k] - _params()[k]).max() for k in want) > 1e-3


def test_a_checkpoint_mid_interval_resumes_exactly(tmp_path):
    batches = _batches(7, seed=3)
    sync = dp.sync.DiLoCo(every=4)
    trainer, whole = _train(sync, optax.adam(1e-2), batches[:2])  # mid-interval: replicas apart
    ckpt = dp.Checkpointer(tmp_path / "run", every=None)
    ckpt.save(whole)
    ckpt.wait()
    for b in batches[2:]:  # the uninterrupted run goes on
        whole, _ = trainer.step(whole, b)
    fresh = dp.Trainer(loss_fn, optax.adam(1e-2), mesh=_mesh(), layout=LAYOUT, sync=sync)
    state = ckpt.restore(2, fresh.init(_params(seed=9), jax.random.key(0)))
    ckpt.close()
    local = jax.device_get(state.opt_state.local)
    assert np.abs(local["w1"][0] - local["w1"][1]).max() > 1e-4  # each replica's own params
    for b in batches[2:]:
        state, _ = fresh.step(state, b)
    want, got = jax.device_get(whole), jax.device_get(state)
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True):
        np.testing.assert_array_equal(g, w)


# ------------------------------------------------------------------- bytes across replicas
def _groups(text: str) -> list[list[int]]:
    """The replica groups of one HLO collective: explicit ``{{0,4},...}``, iota
    ``[4,2]<=[2,4]T(1,0)`` or mesh axes ``mesh['axis_0'=2,'axis_1'=4] {'axis_0'}``."""
    explicit = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", text)
    if explicit:
        return [
            [int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", explicit[1])
        ]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", text)
    if mesh:  # mesh['axis_0'=2,'axis_1'=4] {'axis_0'}: groups along the named mesh axes
        dims = re.findall(r"'(\w+)'=(\d+)", mesh[1])
        names, sizes = [d[0] for d in dims], [int(d[1]) for d in dims]
        along = [names.index(a) for a in re.findall(r"'(\w+)'", mesh[2])]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        ids = ids.transpose([i for i in range(len(sizes)) if i not in along] + along)
        return ids.reshape(-1, int(np.prod([sizes[i] for i in along]))).tolist()
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    assert iota, text
    dims = [int(d) for d in iota[3].split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota[4]:
        ids = ids.transpose([int(d) for d in iota[4].split(",")])
    return ids.reshape(int(iota[1]), int(iota[2])).tolist()


_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "f64": 8, "pred": 1}


def _cross_replica_bytes(hlo: str, replica_of) -> int:
    """Bytes every device sends in the all-reduces whose groups span more than one replica."""
    total = 0
    for line in hlo.splitlines():
        if not re.search(r"= .* all-reduce(-start)?\(", line):
            continue
        if not any(len({replica_of(d) for d in g}) > 1 for g in _groups(line)):
            continue
        result = line.split("=", 1)[1].split("all-reduce", 1)[0]
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def test_only_sync_steps_move_params_across_replicas():
    every = 4
    trainer = dp.Trainer(
        loss_fn, optax.adam(1e-2), mesh=_mesh(), layout=LAYOUT, sync=dp.sync.DiLoCo(every=every)
    )
    state = trainer.init(_params(), jax.random.key(0))
    batch = _batches(1)[0]
    mesh = trainer.mesh
    node = {d.id: i for i, row in enumerate(mesh.devices) for d in row}

    def cross(step):
        fn, args = trainer.step_program(state, batch, step=step)
        return _cross_replica_bytes(fn.lower(*args).compile().as_text(), node.get)

    param_bytes = sum(4 * np.size(v) for v in _params().values())
    inner, sync = cross(0), cross(every - 1)
    assert inner < 64  # the metrics' scalars only: no param or gradient crosses replicas
    assert sync - inner == param_bytes  # one all-reduce of the params' size
    assert cross(every) == inner and cross(2 * every - 1) == sync
    # DDP moves the gradients (the params' size) across replicas every step
    ddp = dp.Trainer(loss_fn, optax.adam(1e-2), mesh=mesh, layout=LAYOUT)
    fn, args = ddp.step_program(ddp.init(_params(), jax.random.key(0)), batch)
    ddp_bytes = _cross_replica_bytes(fn.lower(*args).compile().as_text(), node.get)
    assert ddp_bytes - inner == param_bytes
    per_step = (sync + (every - 1) * inner) / every
    assert ddp_bytes / per_step > 0.9 * every  # about every times fewer bytes per step


def test_streaming_fragments_share_the_params_bytes_between_their_steps():
    sync = dp.sync.StreamingDiLoCo(every=4, fragments=2)
    trainer = dp.Trainer(loss_fn, optax.adam(1e-2), mesh=_mesh(), layout=LAYOUT, sync=sync)
    state = trainer.init(_params(), jax.random.key(0))
    batch = _batches(1)[0]
    node = {d.id: i for i, row in enumerate(trainer.mesh.devices) for d in row}

    def cross(step):
        fn, args = trainer.step_program(state, batch, step=step)
        return _cross_replica_bytes(fn.lower(*args).compile().as_text(), node.get)

    inner = cross(0)  # fragment 1 meets at step 1, fragment 0 at step 3
    assert inner < 64 and cross(2) == inner
    assert cross(3) - inner == 4 * (16 + 1)  # b1, b2
    assert cross(1) - inner == 4 * (64 + 16)  # w1, w2


# ------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"every": 0}, ValueError, r"dp.sync.DiLoCo: every=0 must be at least 1"),
        ({"every": 2.0}, TypeError, r"dp.sync.DiLoCo: every must be an int .* got 2.0 of type"),
        ({"every": True}, TypeError, r"every must be an int"),
        ({"every": 2, "outer": "sgd"}, TypeError, r"outer must be an optax.GradientTrans"),
        ({"every": 2, "inner": dp.sync.DDP}, TypeError, r"inner=dp.sync.DDP is a class"),
        ({"every": 2, "inner": dp.sync.ZeRO1()}, ValueError, r"inner=ZeRO1\(\) is not supported"),
        ({"every": 2, "hook": dp.hooks.Compress(jnp.bfloat16)}, ValueError, r"inner strategy"),
    ],
)
def test_fields_are_checked_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        dp.sync.DiLoCo(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"fragments": 0}, ValueError, r"StreamingDiLoCo: fragments=0 must be between 1 and"),
        ({"fragments": 5}, ValueError, r"fragments=5 must be between 1 and every=4"),
        ({"fragments": 2.0}, TypeError, r"fragments must be an int, got 2.0"),
        ({"mixing": 1.0}, ValueError, r"mixing=1.0 must be in \[0, 1\)"),
        ({"mixing": "0"}, TypeError, r"mixing must be a number in \[0, 1\), got '0'"),
    ],
)
def test_streaming_fields_are_checked(kwargs, error, message):
    with pytest.raises(error, match=message):
        dp.sync.StreamingDiLoCo(every=4, **kwargs)


def test_a_fragment_without_params_is_refused():
    sync = dp.sync.StreamingDiLoCo(every=8, fragments=8)
    trainer = dp.Trainer(loss_fn, optax.sgd(0.1), mesh=_mesh(), layout=LAYOUT, sync=sync)
    with pytest.raises(ValueError, match=r"fragments=8 leaves fragment 2 without a param"):
        trainer.init(_params(), jax.random.key(0))


def test_every_is_checked_for_local_sgd_too():
    with pytest.raises(ValueError, match=r"dp.sync.LocalSGD: every=-1 must be at least 1"):
        dp.sync.LocalSGD(every=-1)
    with pytest.raises(TypeError):
        dp.sync.LocalSGD(every=2, outer=optax.sgd(0.5))  # its outer step is the average


def test_layouts_without_replicas_are_refused():
    sync = dp.sync.DiLoCo(every=2)
    with pytest.raises(ValueError, match=r"no replicate axis of 2 devices or more .* has 1\)"):
        dp.Trainer(loss_fn, optax.sgd(0.1), layout=dp.Layout(replicate=1), sync=sync)
    with pytest.raises(ValueError, match=r"has tensor=.*may name data replicas only"):
        dp.Trainer(loss_fn, optax.sgd(0.1), layout=dp.Layout(replicate=4, tensor=2), sync=sync)
    with pytest.raises(ValueError):  # a shard axis: the replicas hold whole params
        dp.Trainer(loss_fn, optax.sgd(0.1), layout=dp.Layout(shard=8), sync=sync)
    fsdp = dp.sync.LocalSGD(inner=dp.sync.FSDP(), every=2)
    with pytest.raises(ValueError, match=r"inner=FSDP\(\) splits .* has none"):
        dp.Trainer(loss_fn, optax.sgd(0.1), layout=dp.Layout(replicate=8), sync=fsdp)


def test_fsdp_within_each_replica_equals_ddp_within():
    batches = _batches(4, seed=4)
    _, ddp = _train(dp.sync.DiLoCo(every=2), optax.adam(1e-2), batches)
    trainer, fsdp = _train(dp.sync.DiLoCo(inner=dp.sync.FSDP(), every=2), optax.adam(1e-2), batches)
    want, got = jax.device_get(ddp), jax.device_get(fsdp)
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6)
    # each device holds a quarter of its replica's w1 (split over "local")
    w1 = fsdp.opt_state.local["w1"]
    assert w1.shape == (2, IN, WIDTH)
    assert {s.data.shape for s in w1.addressable_shards} == {(1, IN, WIDTH // 4)}
    assert {s.data.shape for s in fsdp.params["w1"].addressable_shards} == {(IN, WIDTH // 4)}
    assert trainer.evaluate(fsdp, batches[:1])["loss"] > 0


def test_an_hsdp_layout_by_degrees_runs_fsdp_within_each_replica():
    batches = _batches(4, seed=4)
    _, want = _train(dp.sync.DiLoCo(every=2), optax.adam(1e-2), batches)
    _, got = _train(
        dp.sync.DiLoCo(inner=dp.sync.FSDP(), every=2),
        optax.adam(1e-2),
        batches,
        dp.Layout(replicate=2, shard=4),
    )
    want, got = jax.device_get(want), jax.device_get(got)
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6)
