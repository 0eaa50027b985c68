"""The Trainer's step exported for GPU (and CPU) on this CPU-only machine: its all-reduces.

``jax.export`` only lowers, so a program for ``platforms=("cuda",)`` can be checked without a
GPU. What the StableHLO shows, counted per category (native grad_sync):

* gradients: jax 0.10 lowers ``lax.psum`` of a bucket's leaves to one ``stablehlo.all_reduce``
  per leaf; the buckets are chained, so the ops form exactly one *wave* per bucket (ops of one
  bucket independent of each other, each depending on every op of the bucket before). A
  combiner that respects data dependencies (XLA's all-reduce combiner) can merge a wave into
  one op and never merge two waves: one all-reduce per bucket, as the compiled XLA:CPU program
  of the exported module shows;
* metrics: one all-reduce of the packed metric vector (loss, accuracy);
* model state: one all-reduce per float leaf of the model state (BatchNorm mean and var),
  reduced every step (``jaxcoll.primitives.all_reduce``, whose lowering is a private function
  called once per leaf).
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import optax
import pytest

from jaxcoll import dp
from tests.dp._models import CNN, MLP, batches, cross_entropy
from tests.helpers import mesh_1d

BUCKET_MB = 0.0001  # ~100 bytes: several buckets, some with several leaves
PLATFORMS = [("cuda",), ("cpu",), ("cuda", "cpu")]

_FUNC = re.compile(r"^  func\.func (?:public|private) @(\w+)\(", re.M)
_OP = re.compile(r'^\s*(%[\w]+)(?::\d+)? = "stablehlo\.all_reduce"\((%[\w#]+)\).*?'
                 r"^\s*\}\) : \((tensor<[^>]*>)\)", re.M | re.S)
_CALL = re.compile(r"^\s*(%[\w]+)(?::\d+)? = (?:func\.)?call @(\w+)\(.*?\) : \(.*?\) -> "
                   r"\(?(tensor<[^>]*>)", re.M)


def _functions(text: str) -> dict[str, str]:
    """Function name -> its body, for the module's top-level functions."""
    starts = [(m.group(1), m.start()) for m in _FUNC.finditer(text)]
    bounds = [s for _, s in starts[1:]] + [len(text)]
    return {name: text[s:e] for (name, s), e in zip(starts, bounds, strict=True)}


def _executed(funcs: dict[str, str], name: str) -> int:
    """All-reduce ops one call of ``name`` executes, through the functions it calls."""
    body = funcs[name]
    calls = re.findall(r"call @(\w+)\(", body)
    return body.count('"stablehlo.all_reduce"') + sum(_executed(funcs, c) for c in calls)


def _waves(body: str) -> list[list[str]]:
    """The inline all-reduces of ``body`` grouped by dependency depth (their shapes)."""
    ops = {m.group(1): m.group(3) for m in _OP.finditer(body)}
    ancestors: dict[str, set[str]] = {}
    for line in body.splitlines():
        m = re.match(r"^\s*(%[\w]+)(?::\d+)? = (.*)$", line)
        if not m:
            continue
        found: set[str] = set()
        for use in re.findall(r"%[\w]+", m.group(2)):
            found |= ancestors.get(use, set()) | ({use} if use in ops else set())
        ancestors[m.group(1)] = found
    depth: dict[str, int] = {}
    for op in ops:  # in program order: an op's ancestors come before it
        depth[op] = 1 + max((depth[a] for a in ancestors[op]), default=-1)
    waves = [[op for op in ops if depth[op] == k] for k in range(max(depth.values()) + 1)]
    for prev, wave in zip(waves, waves[1:]):
        for op in wave:  # every op of a bucket waits for every op of the bucket before
            assert set(prev) <= ancestors[op], (op, prev)
    return [[ops[op] for op in wave] for wave in waves]


def _tensor(shape) -> str:
    return "tensor<" + "".join(f"{d}x" for d in shape) + "f32>"


def _trainer(kind):
    model = dp.Linen(MLP() if kind == "mlp" else CNN(None), cross_entropy)  # CNN: plain BN
    data = batches(kind, 1, 32)
    params, ms = model.init(jax.random.key(0), data[0])
    trainer = dp.Trainer(model, optax.adam(1e-2), mesh=mesh_1d(8, "data"), grad_sync="native",
                         bucket_mb=BUCKET_MB)
    state = trainer.init(params, jax.random.key(1), model_state=ms)
    return trainer, state, data[0], params, ms


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_exported_step_has_one_all_reduce_wave_per_bucket(kind):
    trainer, state, batch, params, ms = _trainer(kind)
    leaves = jax.tree_util.tree_leaves(params)
    buckets = dp.plan_buckets(leaves, BUCKET_MB * 2**20)
    assert 1 < len(buckets) < len(leaves) and max(map(len, buckets)) > 1
    want_waves = [sorted(_tensor(leaves[i].shape) for i in b) for b in buckets]
    state_leaves = jax.tree_util.tree_leaves(ms)  # BatchNorm mean and var for the CNN
    step, args = trainer.step_program(state, batch)
    for platforms in PLATFORMS:
        exported = jax.export.export(step, platforms=platforms)(*args)
        funcs = _functions(exported.mlir_module())
        waves = _waves(funcs["main"])
        assert [sorted(w) for w in waves] == want_waves, platforms
        calls = Counter(shape for _, callee, shape in _CALL.findall(funcs["main"])
                        for _ in range(_executed(funcs, callee)))
        want_calls = Counter({"tensor<2xf32>": 1})  # the metrics: loss and accuracy, one vector
        for leaf in state_leaves:  # the model state: one per float leaf
            want_calls[_tensor(leaf.shape)] += 1
        assert calls == want_calls, platforms
        total = _executed(funcs, "main")
        assert total == len(leaves) + 1 + len(state_leaves), (platforms, total)
        print(f"{kind} {platforms}: {total} stablehlo.all_reduce executed: gradients "
              f"{sum(map(len, waves))} in {len(waves)} waves (buckets {list(map(len, buckets))}),"
              f" metrics 1, model state {len(state_leaves)}")


def test_exported_module_compiles_to_one_all_reduce_per_bucket_on_cpu():
    trainer, state, batch, params, _ = _trainer("mlp")
    leaves = jax.tree_util.tree_leaves(params)
    buckets = dp.plan_buckets(leaves, BUCKET_MB * 2**20)
    step, args = trainer.step_program(state, batch)
    exported = jax.export.export(step, platforms=("cuda", "cpu"))(*args)
    hlo = jax.jit(exported.call).lower(*args).compile().as_text()
    ops = re.findall(r"^\s*%\S+ = (\(.*?\)|\S+) all-reduce\(", hlo, re.M)
    groups = sorted(sorted(s for s in re.findall(r"\w+(\[[\d,]*\])", op) if s != "[2]")
                    for op in ops)  # [2]: the metrics, which XLA may merge into a bucket
    want = sorted(sorted(f"[{','.join(map(str, leaves[i].shape))}]" for i in b)
                  for b in buckets)
    assert [g for g in groups if g] == want
    assert len(ops) in (len(buckets), len(buckets) + 1)
