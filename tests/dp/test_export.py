"""The Trainer's step exported for GPU (and CPU) on this CPU-only machine: its all-reduces.

``jax.export`` only lowers, so a program for ``platforms=("cuda",)`` can be checked without a
GPU. What the StableHLO shows, counted per category (``dp.sync.DDP(algorithm="native")``):

* gradients: jax 0.10 lowers ``lax.psum`` of a bucket's leaves to one ``stablehlo.all_reduce``
  per leaf. No gradient all-reduce depends on any other collective's result (each bucket's
  depends only on its own gradients: an overlap-ready step, which XLA's scheduler may start
  as soon as the backward pass has produced the bucket), and they come in DDP's order, bucket
  by bucket (the last leaves first). XLA's all-reduce combiner may merge independent ones: in
  the compiled XLA:CPU program every gradient is in exactly one all-reduce op, and an op never
  splits a bucket;
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
_OP = re.compile(
    r'^\s*(%[\w]+)(?::\d+)? = "stablehlo\.all_reduce"\((%[\w#]+)\).*?'
    r"^\s*\}\) : \((tensor<[^>]*>)\)",
    re.M | re.S,
)
_CALL = re.compile(
    r"^\s*(%[\w]+)(?::\d+)? = (?:func\.)?call @(\w+)\(.*?\) : \(.*?\) -> "
    r"\(?(tensor<[^>]*>)",
    re.M,
)


def _functions(text: str) -> dict[str, str]:
    """Function name -> its body, for the module's top-level functions."""
    starts = [(m.group(1), m.start()) for m in _FUNC.finditer(text)]
    bounds = [s for _, s in starts[1:]] + [len(text)]
    return {name: text[s:e] for (name, s), e in zip(starts, bounds, strict=True)}


def _executed(funcs: dict[str, str], name: str, op: str = "stablehlo.all_reduce") -> int:
    """``op`` ops one call of ``name`` executes, through the functions it calls."""
    body = funcs[name]
    calls = re.findall(r"call @(\w+)\(", body)
    return body.count(f'"{op}"') + sum(_executed(funcs, c, op) for c in calls)


def _grad_order(body: str) -> list[str]:
    """The inline all-reduces of ``body`` (their shapes, in program order), after checking
    that none depends on another all-reduce's result."""
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
    for op in ops:
        assert not ancestors[op], (op, ancestors[op])  # independent of every other collective
    return list(ops.values())


def _tensor(shape) -> str:
    return "tensor<" + "".join(f"{d}x" for d in shape) + "f32>"


def _trainer(kind):
    model = dp.Linen(MLP() if kind == "mlp" else CNN(None), cross_entropy)  # CNN: plain BN
    data = batches(kind, 1, 32)
    params, ms = model.init(jax.random.key(0), data[0])
    trainer = dp.Trainer(
        model,
        optax.adam(1e-2),
        mesh=mesh_1d(8, "data"),
        sync=dp.sync.DDP(algorithm="native", bucket_mb=BUCKET_MB),
    )
    state = trainer.init(params, jax.random.key(1), model_state=ms)
    return trainer, state, data[0], params, ms


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_exported_step_reduces_each_bucket_independently_in_ddp_order(kind):
    trainer, state, batch, params, ms = _trainer(kind)
    leaves = jax.tree_util.tree_leaves(params)
    buckets = dp.plan_buckets(leaves, BUCKET_MB * 2**20)
    assert 1 < len(buckets) < len(leaves) and max(map(len, buckets)) > 1
    want_buckets = [sorted(_tensor(leaves[i].shape) for i in b) for b in buckets]
    state_leaves = jax.tree_util.tree_leaves(ms)  # BatchNorm mean and var for the CNN
    step, args = trainer.step_program(state, batch)
    for platforms in PLATFORMS:
        exported = jax.export.export(step, platforms=platforms)(*args)
        funcs = _functions(exported.mlir_module())
        order = _grad_order(funcs["main"])
        got, k = [], 0
        for b in buckets:  # program order: bucket after bucket, as plan_buckets lists them
            got.append(sorted(order[k : k + len(b)]))
            k += len(b)
        assert got == want_buckets and k == len(order), platforms
        calls = Counter(
            shape
            for _, callee, shape in _CALL.findall(funcs["main"])
            for _ in range(_executed(funcs, callee))
        )
        want_calls = Counter({"tensor<2xf32>": 1})  # the metrics: loss and accuracy, one vector
        for leaf in state_leaves:  # the model state: one per float leaf
            want_calls[_tensor(leaf.shape)] += 1
        assert calls == want_calls, platforms
        total = _executed(funcs, "main")
        assert total == len(leaves) + 1 + len(state_leaves), (platforms, total)
        print(
            f"{kind} {platforms}: {total} stablehlo.all_reduce executed: gradients "
            f"{len(order)} independent, in bucket order (buckets {list(map(len, buckets))}),"
            f" metrics 1, model state {len(state_leaves)}"
        )


def test_exported_module_compiles_each_bucket_into_one_all_reduce_on_cpu():
    trainer, state, batch, params, _ = _trainer("mlp")
    leaves = jax.tree_util.tree_leaves(params)
    buckets = dp.plan_buckets(leaves, BUCKET_MB * 2**20)
    step, args = trainer.step_program(state, batch)
    exported = jax.export.export(step, platforms=("cuda", "cpu"))(*args)
    hlo = jax.jit(exported.call).lower(*args).compile().as_text()
    ops = re.findall(r"^\s*%\S+ = (\(.*?\)|\S+) all-reduce\(", hlo, re.M)
    groups = [
        sorted(s for s in re.findall(r"\w+(\[[\d,]*\])", op) if s != "[2]") for op in ops
    ]  # [2]: the metrics, which XLA may merge into a bucket
    assert_whole_buckets([g for g in groups if g], leaves, buckets)


def assert_whole_buckets(groups: list[list[str]], leaves, buckets) -> None:
    """Each compiled all-reduce op (its operand shapes) is a union of whole buckets, and every
    gradient leaf is in exactly one op."""
    shape = lambda i: f"[{','.join(map(str, leaves[i].shape))}]"  # noqa: E731
    assert sorted(s for g in groups for s in g) == sorted(shape(i) for i in range(len(leaves)))
    left = [sorted(shape(i) for i in b) for b in buckets]
    for g in groups:
        rest = list(g)
        for b in [b for b in left if all(rest.count(s) >= b.count(s) for s in b)]:
            if all(rest.count(s) >= b.count(s) for s in b):
                for s in b:
                    rest.remove(s)
                left.remove(b)
        assert not rest, (g, buckets)  # the op holds part of a bucket
