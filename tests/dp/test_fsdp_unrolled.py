"""FSDP on models written as a Python loop over their blocks (no scan, no stacked params).

Each block is gathered where the forward first uses it and gathered again where the backward
reaches it, so the step's peak stays near the scanned model's: checked on the compiled step's
``memory_analysis()`` (argument + temp bytes per device) against the same blocks stacked and
scanned, on the compiled HLO (the backward's gathers survive XLA's optimizations instead of
being merged with the forward's), and against a single-device run for the values.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcoll import dp
from jaxcoll.dp.sync.blocks import block_units
from tests.dp._models import max_rel_diff
from tests.helpers import mesh_1d

N = 8
WIDTH, LAYERS, SIZE = 128, 8, 32


def _block(h, p):
    """A pre-LayerNorm residual MLP block: norm scale and bias, two Dense with biases, GELU
    (the small params are read by cheap ops XLA fuses, the kernels by matmuls)."""
    mu = h.mean(-1, keepdims=True)
    z = (h - mu) * lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    z = z * p["ln"]["scale"] + p["ln"]["bias"]
    z = jax.nn.gelu(z @ p["fc"]["kernel"] + p["fc"]["bias"])
    return h + z @ p["proj"]["kernel"] + p["proj"]["bias"]


def _params(seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale):
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

    return [
        {
            "ln": {"scale": 1.0 + normal(WIDTH, scale=0.1), "bias": normal(WIDTH, scale=0.1)},
            "fc": {
                "kernel": normal(WIDTH, 2 * WIDTH, scale=0.1),
                "bias": normal(2 * WIDTH, scale=0.1),
            },
            "proj": {
                "kernel": normal(2 * WIDTH, WIDTH, scale=0.1),
                "bias": normal(WIDTH, scale=0.1),
            },
        }
        for _ in range(LAYERS)
    ]


def _unrolled_loss(params, batch, rng=None):
    h = batch["x"]
    for p in params:  # a Python loop over a list of blocks
        h = _block(h, p)
    return jnp.mean((h - batch["y"]) ** 2), {}


def _scanned_loss(params, batch, rng=None):
    h, _ = lax.scan(lambda h, p: (_block(h, p), None), batch["x"], params)
    return jnp.mean((h - batch["y"]) ** 2), {}


def _batch(seed=1, size=SIZE):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(size, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(size, WIDTH)).astype(np.float32),
    }


def _compiled(loss, params, batch, sync, opt=None):
    trainer = dp.Trainer(loss, opt or optax.adam(1e-3), mesh=mesh_1d(N, "data"), sync=sync)
    state = trainer.init(params, jax.random.key(0))
    step, args = trainer.step_program(state, batch)
    return step.lower(*args).compile()


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes


def test_block_units_are_the_repeated_subtrees():
    blocks = {f"h_{i}": {"w": np.zeros((4, 4)), "b": np.zeros(4)} for i in range(3)}
    params = {
        "emb": np.zeros((5, 4)),
        **blocks,
        "norm": {"scale": np.zeros(4), "bias": np.zeros(4)},
    }
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    units = dict(zip(paths, block_units(params), strict=True))
    assert units["['emb']"] is None and units["['norm']['scale']"] is None  # not repeated
    assert units["['h_0']['w']"] == units["['h_0']['b']"] != units["['h_1']['w']"]
    assert len({units[f"['h_{i}']['w']"] for i in range(3)}) == 3
    # a list of matrices: each its own block; the stacked leaves of a scanned model: none
    assert block_units([np.zeros((4, 4))] * 3) == [0, 1, 2]
    assert block_units({"w": np.zeros((3, 4, 4)), "b": np.zeros((3, 4))}) == [None, None]


def test_unrolled_peak_stays_near_the_scanned_ones():
    # The same 8 blocks, stacked and scanned vs a list in a Python loop, default FSDP. Before
    # the backward's gathers were tied to it, XLA:CPU merged them with the forward's (it drops
    # jax.checkpoint's optimization barriers) and the default bucket (25 MiB) held all blocks
    # in one gather: the unrolled peak was about ZeRO-1's (2.6x the scanned one here).
    unrolled = _params()
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *unrolled)
    batch = _batch()
    peaks = {
        "scanned": _peak(_compiled(_scanned_loss, stacked, batch, dp.sync.FSDP())),
        "unrolled": _peak(_compiled(_unrolled_loss, unrolled, batch, dp.sync.FSDP())),
        "per leaf": _peak(_compiled(_unrolled_loss, unrolled, batch, dp.sync.FSDP(bucket_mb=None))),
        "zero1": _peak(_compiled(_unrolled_loss, unrolled, batch, dp.sync.ZeRO1())),
    }
    print({k: f"{v / 2**20:.2f} MiB" for k, v in peaks.items()})
    assert peaks["unrolled"] <= 1.2 * peaks["scanned"], peaks
    assert peaks["per leaf"] <= 1.2 * peaks["scanned"], peaks
    assert peaks["unrolled"] < 0.5 * peaks["zero1"], peaks


def test_the_compiled_backward_gathers_each_block_again():
    # In the optimized HLO: the forward gathers every block once, the backward gathers again
    # the blocks whose inputs' gradient needs their kernels (all but the first block), and
    # no gathered block is left to the backward from the forward: XLA kept the re-gathers.
    unrolled = _params()
    text = _compiled(_unrolled_loss, unrolled, _batch(), dp.sync.FSDP()).as_text()
    gathers = len(re.findall(r"= \S+ all-gather\(", text))
    scatters = len(re.findall(r"= \S+ reduce-scatter\(", text))
    # per block: each kernel alone and the vectors (norm, biases) packed, 3 gathers
    assert scatters == 3 * LAYERS, scatters
    assert gathers >= 3 * LAYERS + 2 * (LAYERS - 1), (gathers, scatters)


def test_unrolled_fsdp_equals_one_device():
    # Plain SGD: the params are linear in the gradient, so any error in the gathered params
    # or the reduce-scattered gradient shows; 3 steps, each on its own batch.
    params = _params()
    batches = [_batch(seed) for seed in (1, 2, 3)]
    lr = 0.1
    trainer = dp.Trainer(
        _unrolled_loss, optax.sgd(lr), mesh=mesh_1d(N, "data"), sync=dp.sync.FSDP()
    )
    state = trainer.init(params, jax.random.key(0))
    ref = params
    grad = jax.jit(jax.grad(lambda p, b: _unrolled_loss(p, b)[0]))
    for b in batches:
        state, _ = trainer.step(state, b)
        ref = jax.tree.map(lambda p, g: p - lr * g, ref, grad(ref, b))
    assert max_rel_diff(jax.device_get(state.params), ref) <= 1e-5


def _hlo_graph(text: str) -> dict[str, tuple[str, list[str]]]:
    """The entry computation of a compiled HLO module: each instruction's name -> (its
    text, the names of its operands)."""
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n")]
    nodes: dict[str, tuple[str, list[str]]] = {}
    for line in entry.splitlines()[2:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)", line)
        if m:
            name, rest = m.groups()
            nodes[name] = (rest, re.findall(r"%([\w.\-]+)", rest.split(", metadata=")[0]))
    return {k: (rest, [o for o in ops if o in nodes]) for k, (rest, ops) in nodes.items()}


def _ancestors(nodes, name: str) -> set[str]:
    seen: set[str] = set()
    todo = list(nodes[name][1])
    while todo:
        x = todo.pop()
        if x not in seen:
            seen.add(x)
            todo.extend(nodes[x][1])
    return seen


def _nearest_parameter(nodes, name: str) -> str:
    """The entry parameter closest to ``name`` among its ancestors (breadth first): the
    slice a gather gathers (a tie's token comes from farther away)."""
    level = [name]
    while level:
        found = sorted(x for x in level if " parameter(" in nodes[x][0])
        if found:
            return found[0]
        level = [o for x in level for o in nodes[x][1]]
    raise AssertionError(f"{name} reads no parameter")


@functools.lru_cache(maxsize=2)
def _step_graph(sync):
    """The compiled step's entry of the unrolled model under ``sync``: ``(nodes, anc,
    forward, regathers, block, source, users)``: the kernel gathers of the forward in block
    order and the backward's re-gathers, each gather's ancestors and users, and the block
    of each kernel slice."""
    nodes = _hlo_graph(_compiled(_unrolled_loss, _params(), _batch(), sync).as_text())
    kernel = f"f32[8,{2 * WIDTH * WIDTH // N}]"
    gathers = [g for g, (rest, _) in nodes.items() if " all-gather(" in rest]
    anc = {g: _ancestors(nodes, g) for g in gathers}
    # A gather of the forward waits for an earlier block's inputs, so the gathers of the
    # blocks before are among its ancestors; a re-gather is tied to a cotangent, which
    # waits for the whole forward: every forward gather is among its ancestors. So the
    # 2 * LAYERS kernel gathers with the fewest gathers among their ancestors are the
    # forward's. Its source: the slice.
    kernels = [g for g in gathers if nodes[g][0].startswith(kernel)]
    fewest = sorted(kernels, key=lambda g: len(anc[g] & set(gathers)))
    forward, regathers = fewest[: 2 * LAYERS], fewest[2 * LAYERS :]
    assert len(anc[regathers[0]] & set(forward)) == len(forward)
    source = {g: _nearest_parameter(nodes, g) for g in kernels}
    users = {g: {u for u, (_, ops) in nodes.items() if g in ops} for g in gathers}
    # Forward order: block k's kernels are used after block k-1's (more ancestors).
    order = sorted(forward, key=lambda g: min(len(_ancestors(nodes, u)) for u in users[g]))
    block = {source[g]: i // 2 for i, g in enumerate(order)}  # two kernels a block
    assert len(order) == 2 * LAYERS and len(block) == 2 * LAYERS
    return nodes, anc, order, regathers, block, source, users


def _waits_for_the_next_block(sync) -> dict[int, bool]:
    """Per block k of the unrolled model (1 <= k < LAYERS - 2), whether one of its
    re-gathers in the compiled step has, among its ancestors, an instruction that uses block
    k+1's re-gathered kernels (block k+1's backward matmuls)."""
    _, anc, _, regathers, block, source, users = _step_graph(sync)
    of = {k: [g for g in regathers if block[source[g]] == k] for k in range(LAYERS)}
    waits = {}
    for k in range(1, LAYERS - 2):  # the last two blocks wait for their own cotangent
        assert of[k] and of[k + 1], (k, of)
        after = set().union(*(users[g] for g in of[k + 1]))
        waits[k] = any(after & anc[g] for g in of[k])
    return waits


def _forward_waits_for(sync) -> dict[int, int]:
    """Per block k, the latest block whose forward gathers are among the ancestors of
    block k's forward gathers (-1: none: the gather may be hoisted to the step's start)."""
    _, anc, order, _, block, source, _ = _step_graph(sync)
    latest = {}
    for k in range(LAYERS):
        mine = [g for g in order if block[source[g]] == k]
        before = [block[source[a]] for g in mine for a in anc[g] if a in order]
        latest[k] = max(before, default=-1)
    return latest


def test_the_forward_gathers_one_block_ahead_not_all_at_the_start():
    # torch FSDP's limit_all_gathers: block k's forward gather waits for block k-1's
    # inputs (prefetch: it may overlap block k-1's compute), so XLA cannot hoist every
    # block's gather to the start of the step and keep them all alive (XLA:GPU's combiners
    # merge such gathers into one). prefetch=False: it waits for its own inputs.
    ahead = _forward_waits_for(dp.sync.FSDP())
    assert [ahead[k] for k in range(2, LAYERS)] == list(range(LAYERS - 2)), ahead
    own = _forward_waits_for(dp.sync.FSDP(prefetch=False))
    assert [own[k] for k in range(1, LAYERS)] == list(range(LAYERS - 1)), own


def test_the_backward_prefetches_the_next_block():
    # torch FSDP's backward prefetch: block k's re-gather may start while block k+1's
    # backward computes, so no instruction that uses block k+1's re-gathered kernels is an
    # ancestor of block k's re-gathers. prefetch=False: each waits for the cotangent block
    # k+1's backward computes (the gather exposed; one block gathered at a time).
    assert not any(_waits_for_the_next_block(dp.sync.FSDP()).values())
    assert all(_waits_for_the_next_block(dp.sync.FSDP(prefetch=False)).values())
