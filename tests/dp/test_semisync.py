"""dp.sync.DiLoCo, dp.sync.LocalSGD and dp.sync.StreamingDiLoCo: semi-synchronous training
against a NumPy reference of the algorithm (8-bit pseudo-gradients included), against DDP where
they coincide, the bytes that cross replicas per step, and what a streaming fragment's
all-reduce waits for."""

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


def _params(seed=0, width=WIDTH):
    r = np.random.default_rng(seed)
    return {
        "w1": (r.normal(size=(IN, width)) / 2).astype(np.float32),
        "b1": np.zeros(width, np.float32),
        "w2": (r.normal(size=(width, 1)) / 4).astype(np.float32),
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


def np_quantized_mean(deltas, block):
    """The replicas' mean pseudo-gradient sent in int8 (``dp.Quantize(grads=jnp.int8)``):
    each replica's leaves (``deltas[r]``: a list, leaf order) flattened, each padded to whole
    blocks, into R rows; row j of every replica quantized per block and averaged by replica j
    (float32), the average quantized again and gathered. Returns the leaves' means."""
    count = len(deltas)

    def rounded(x):  # per block of ``block``: amax / 127 scales, nearest int8, back
        x = x.reshape(-1, block)
        amax = np.abs(x).max(1, keepdims=True)
        scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
        return (np.clip(np.round(x / scale), -127, 127) * scale).astype(np.float32).reshape(-1)

    rows = []
    for leaves in deltas:
        flat = np.concatenate([np.pad(d.ravel(), (0, -d.size % block)) for d in leaves])
        rows.append(np.pad(flat, (0, -flat.size % (count * block))).astype(np.float32))
    parts = [np.split(rounded(row), count) for row in rows]  # parts[r][j]: to replica j
    mean = np.concatenate(
        [rounded(np.mean([parts[r][j] for r in range(count)], 0)) for j in range(count)]
    )
    out, at = [], 0
    for d in deltas[0]:
        out.append(mean[at : at + d.size].reshape(d.shape).astype(np.float64))
        at += d.size + (-d.size % block)
    return out


def np_diloco(
    params,
    batches,
    replicas,
    every,
    inner_lr,
    outer_lr,
    momentum,
    groups=None,
    mixing=0,
    overlap=False,
    block=None,
    warmup=0,
):
    """DiLoCo as its paper writes it: per replica Adam on its rows, Nesterov outer steps. With
    ``groups`` (lists of param names, leaf order), Streaming DiLoCo: group p meets where
    ``(step + 1 + p * every // len(groups)) % every == 0``, replicas keeping ``mixing``; with
    ``overlap``, its pseudo-gradient from the params before that step's inner update. With
    ``block``, the pseudo-gradients' mean travels in int8 (:func:`np_quantized_mean`). The
    first ``warmup`` steps are Adam on the whole batch's gradient in every replica (DDP's),
    the global params following; the intervals count from there."""
    init, inner_step = np_adam(inner_lr)
    groups = groups or [sorted(params)]
    glob = {k: v.astype(np.float64) for k, v in params.items()}
    local = [dict(glob) for _ in range(replicas)]
    states = [init(glob) for _ in range(replicas)]
    trace = {k: 0 * v for k, v in glob.items()}
    for step, b in enumerate(batches):
        if step < warmup:  # every replica the whole batch's gradient: the same Adam step
            g = np_grads(glob, b["x"].astype(np.float64), b["y"])
            steps = [inner_step(glob, g, s) for s in states]
            local, states = [dict(p) for p, _ in steps], [s for _, s in steps]
            glob = dict(local[0])
            continue
        step -= warmup
        start = [dict(loc) for loc in local]  # each replica's params before this step
        rows = len(b["x"]) // replicas
        for r in range(replicas):  # replica r: its block of rows of the global batch
            part = slice(r * rows, (r + 1) * rows)
            g = np_grads(local[r], b["x"][part].astype(np.float64), b["y"][part])
            local[r], states[r] = inner_step(local[r], g, states[r])
        local = [dict(loc) for loc in local]
        for p, keys in enumerate(groups):
            if (step + 1 + p * every // len(groups)) % every:
                continue
            sent = start if overlap else local
            if block is None:
                deltas = [glob[k] - np.mean([loc[k] for loc in sent], 0) for k in keys]
            else:
                each = [[(glob[k] - loc[k]).astype(np.float32) for k in keys] for loc in sent]
                deltas = np_quantized_mean(each, block)
            for k, delta in zip(keys, deltas, strict=True):
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


def test_synchronous_warmup_steps_then_diloco_equal_the_numpy_reference():
    batches = _batches(14, seed=7)
    sync = dp.sync.DiLoCo(every=4, warmup=5, outer=optax.sgd(0.7, momentum=0.9, nesterov=True))
    trainer, state = _train(sync, optax.adam(1e-2), batches[:5])
    # the warm-up is DDP: the global params are Adam's on the whole batch, each step
    _, ddp = _train(dp.sync.DDP(), optax.adam(1e-2), batches[:5])
    for k, want in jax.device_get(ddp.params).items():
        np.testing.assert_allclose(jax.device_get(state.params)[k], want, atol=1e-6, err_msg=k)
    for b in batches[5:]:
        state, _ = trainer.step(state, b)
    want = np_diloco(_params(), batches, 2, 4, 1e-2, 0.7, 0.9, warmup=5)
    got = jax.device_get(state.params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, err_msg=k)
    # the meetings count from the warm-up's end: steps 8 and 12 (the 4th and 8th after it)
    phases = [sync.phase(step) for step in range(14)]
    assert [p._warm for p in phases] == [True] * 5 + [False] * 9
    assert [s for s, p in enumerate(phases) if p._sync] == [8, 12]
    # and the warm-up is another run than DiLoCo from the start
    plain = np_diloco(_params(), batches, 2, 4, 1e-2, 0.7, 0.9)
    assert max(np.abs(plain[k] - want[k]).max() for k in want) > 1e-3


@pytest.mark.parametrize("overlap, warmup", [(True, 3), (False, 0)])
def test_streaming_diloco_equals_the_numpy_reference(overlap, warmup):
    batches = _batches(12, seed=5)
    sync = dp.sync.StreamingDiLoCo(
        every=4,
        fragments=2,
        mixing=0.25,
        overlap=overlap,
        warmup=warmup,
        outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
    )
    _, state = _train(sync, optax.adam(1e-2), batches)
    # leaves b1 (16), b2 (1), w1 (64), w2 (16): middles 8, 16.5, 49, 89 of 97 -> 0, 0, 1, 1
    groups = [["b1", "b2"], ["w1", "w2"]]
    args = (_params(), batches, 2, 4, 1e-2, 0.7, 0.9, groups, 0.25)
    want = np_diloco(*args, overlap, warmup=warmup)
    got = jax.device_get(state.params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, err_msg=k)
    assert len(state.opt_state.outer) == 2
    # the other schedule is another run: the reference tells them apart
    other = np_diloco(*args, not overlap, warmup=warmup)
    assert max(np.abs(other[k] - want[k]).max() for k in want) > 1e-3


def test_int8_pseudo_gradients_equal_the_numpy_reference():
    batches = _batches(12, seed=6)
    quantize = dp.Quantize(grads=jnp.int8, block=16)  # 16 elements per scale: several per leaf
    _, state = _train(dp.sync.DiLoCo(every=4, quantize=quantize), optax.adam(1e-2), batches)
    want = np_diloco(_params(), batches, 2, 4, 1e-2, 0.7, 0.9, block=16)
    got = jax.device_get(state.params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, err_msg=k)
    # the rounding is there, and small: against the float32 pseudo-gradients' run
    exact = np_diloco(_params(), batches, 2, 4, 1e-2, 0.7, 0.9)
    gap = max(np.abs(exact[k] - want[k]).max() for k in want)
    assert 1e-5 < gap < 1e-2, gap
    # a streaming fragment's pseudo-gradient quantized too (with overlap)
    groups = [["b1", "b2"], ["w1", "w2"]]
    sync = dp.sync.StreamingDiLoCo(every=4, fragments=2, mixing=0.5, quantize=quantize)
    _, state = _train(sync, optax.adam(1e-2), batches)
    want = np_diloco(_params(), batches, 2, 4, 1e-2, 0.7, 0.9, groups, 0.5, True, 16)
    got = jax.device_get(state.params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, err_msg=k)


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


_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "f64": 8, "pred": 1, "s8": 1}


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


#: Bytes a device sends per byte of a collective's result, in a group of n (ring all-reduce:
#: a reduce-scatter then an all-gather).
_WIRE = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
}


def _cross_replica_wire_bytes(hlo: str, replica_of) -> float:
    """Bytes every device sends over the wire in the collectives whose groups span more than
    one replica (all-reduces, all-gathers and all-to-alls)."""
    total = 0.0
    for line in hlo.splitlines():
        op = re.search(r"= .* (all-reduce|all-gather|all-to-all)\(", line)
        if not op:
            continue
        groups = _groups(line)
        if not any(len({replica_of(d) for d in g}) > 1 for g in groups):
            continue
        result = line.split("=", 1)[1].split(op[1], 1)[0]
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            size = _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
            total += _WIRE[op[1]](len(groups[0])) * size
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
        ({"every": 2, "warmup": -1}, ValueError, r"DiLoCo: warmup=-1 must be at least 0"),
        ({"every": 2, "warmup": 1.5}, TypeError, r"DiLoCo: warmup must be an int .* got 1.5"),
        ({"every": 2, "outer": "sgd"}, TypeError, r"outer must be an optax.GradientTrans"),
        ({"every": 2, "inner": dp.sync.DDP}, TypeError, r"inner=dp.sync.DDP is a class"),
        ({"every": 2, "inner": dp.sync.ZeRO1()}, ValueError, r"inner=ZeRO1\(\) is not supported"),
        ({"every": 2, "hook": dp.hooks.Compress(jnp.bfloat16)}, ValueError, r"inner strategy"),
        ({"every": 2, "quantize": "int8"}, TypeError, r"quantize must be a dp.Quantize or None"),
        (
            {"every": 2, "quantize": dp.Quantize(params=jnp.int8)},
            ValueError,
            r"DiLoCo: quantize=.* must name the pseudo-gradients' dtype as grads",
        ),
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
        ({"overlap": 1}, TypeError, r"StreamingDiLoCo: overlap must be True or False, got 1"),
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


def test_int8_pseudo_gradients_cut_the_bytes_across_replicas_about_4x():
    params = _params(width=1024)  # w1 4096, b1 1024, w2 1024, b2 1: 6145 elements
    batch = _batches(1)[0]
    node = {d.id: i for i, row in enumerate(_mesh().devices) for d in row}

    def wire(quantize):
        sync = dp.sync.DiLoCo(every=2, quantize=quantize)
        trainer = dp.Trainer(loss_fn, optax.adam(1e-2), mesh=_mesh(), layout=LAYOUT, sync=sync)
        state = trainer.init(params, jax.random.key(0))
        out = []
        for step in (0, 1):  # an inner step, a sync step
            fn, args = trainer.step_program(state, batch, step=step)
            out.append(_cross_replica_wire_bytes(fn.lower(*args).compile().as_text(), node.get))
        return out[1] - out[0]  # the pseudo-gradients' bytes

    exact = wire(None)
    assert exact == 2 * (2 - 1) / 2 * 4 * 6145  # one float32 all-reduce over 2 replicas
    int8 = wire(dp.Quantize(grads=jnp.int8))
    # each leaf padded to 256-element blocks (b2: 256), then to rows of 2 x 256: 6656 bytes
    # and 26 float32 scales, all-to-all'd then all-gathered, half of each sent
    assert int8 == 2 * (6656 + 4 * 26) / 2
    assert exact / int8 > 3.5


# ------------------------------------------------------- a streaming fragment's overlap
def _entry(hlo: str) -> dict[str, tuple[str, list[str]]]:
    """The entry computation's instructions in their scheduled order: name -> (line, the
    names it reads)."""
    out = {}
    for line in hlo[hlo.index("\nENTRY") :].splitlines()[1:]:
        if line.startswith("}"):
            break
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
        if m:
            out[m[1]] = (line, re.findall(r"%([\w.\-]+)", m[2]))
    return out


def _reads_the_batch(entry) -> set[str]:
    """The instructions that depend on the batch (the printed order is topological)."""
    seen = {name for name, (line, _) in entry.items() if 'op_name="batch[' in line}
    assert len(seen) == 2  # x and y
    for name, (_, reads) in entry.items():
        if any(r in seen for r in reads):
            seen.add(name)
    return seen


@pytest.mark.parametrize("overlap", [True, False])
def test_a_fragments_all_reduce_does_not_wait_for_the_step(overlap):
    sync = dp.sync.StreamingDiLoCo(every=4, fragments=2, overlap=overlap)
    trainer = dp.Trainer(loss_fn, optax.adam(1e-2), mesh=_mesh(), layout=LAYOUT, sync=sync)
    state = trainer.init(_params(), jax.random.key(0))
    node = {d.id: i for i, row in enumerate(trainer.mesh.devices) for d in row}
    fn, args = trainer.step_program(state, _batches(1)[0], step=1)  # fragment 1: w1, w2
    entry = _entry(fn.lower(*args).compile().as_text())
    meets = [
        name
        for name, (line, _) in entry.items()
        if re.search(r"= .* all-reduce\(", line)
        and _cross_replica_bytes(line, node.get) == 4 * (64 + 16)
    ]
    assert len(meets) == 1, meets
    batch_side = _reads_the_batch(entry)
    order = list(entry)
    if overlap:
        # its operand is the step's input params: no data dependence on the gradients ...
        assert meets[0] not in batch_side
        # ... and the compiled schedule runs it before forward/backward ops (XLA:CPU's order)
        later = [n for n in order[order.index(meets[0]) :] if n in batch_side]
        assert any("fusion" in n or "dot" in n for n in later), later
    else:  # the pseudo-gradient after the inner update: it waits for the gradients
        assert meets[0] in batch_side
