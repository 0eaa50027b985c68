"""Context parallel inside the Trainer: 20 steps of a causal attention model with each sequence
split over a context axis (alone, and with FSDP and tensor parallel; ring attention and
Ulysses) equal 20 steps of plain optax on one device, Adam and plain SGD (twin copies)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

from jaxcoll import dp, parallel
from jaxcoll import nn as pnn
from tests.dp._models import max_rel_diff, token_batches, twin_optimizer

VOCAB, WIDTH, HEADS, SEQ, BATCH, STEPS = 16, 16, 4, 16, 8, 20


class Tiny(nn.Module):
    """Token and position embeddings, one causal attention layer (jaxcoll.nn: split over
    the tensor role, ring or Ulysses over the context role), a head."""

    method: parallel.Ring | parallel.Ulysses = parallel.Ring()  # noqa: RUF009

    @nn.compact
    def __call__(self, x):
        h = nn.Embed(VOCAB, WIDTH)(x)
        pos = self.param("wpe", nn.initializers.normal(0.1), (SEQ, WIDTH))
        h = h + pos[parallel.context_positions(x.shape[1])]
        # no biases: the key bias has a zero gradient (softmax is shift-invariant), which
        # Adam would turn into steps of rounding noise
        attn = pnn.ParallelSelfAttention(HEADS, use_bias=False, causal=True, context=self.method)
        h = h + attn(h)
        return nn.Dense(VOCAB)(h)


def _loss(method):
    model = Tiny(method)

    def loss(params, batch, rng=None):
        total = 0.0
        for copy in ("adam", "sgd"):
            logits = model.apply({"params": params[copy]}, batch["x"])
            logp = jax.nn.log_softmax(logits)
            total += -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))
        return total, {}

    return loss


def _params(boxed=False):
    """The twin copies' params; ``boxed``: with the attention's partition boxes, which tell
    a Trainer its tensor split."""
    init = Tiny().init
    x = jnp.zeros((1, SEQ), jnp.int32)
    params = {copy: init(jax.random.key(i), x)["params"] for i, copy in enumerate(("adam", "sgd"))}
    return params if boxed else nn.unbox(params)


def _batches():
    return token_batches(STEPS, BATCH, SEQ, VOCAB)


@pytest.fixture(scope="module")
def reference():
    # Plain optax on one device, the model dense (no axis bound).
    loss = _loss(parallel.Ring())
    tx = twin_optimizer()
    params = _params()
    opt = tx.init(params)
    grad = jax.jit(jax.grad(lambda p, b: loss(p, b)[0]))
    for b in _batches():
        updates, opt = tx.update(grad(params, b), opt, params)
        params = optax.apply_updates(params, updates)
    return jax.device_get(params)


#: (layout's name, the attention over the context axis)
LAYOUTS = [
    ("dp4xcp2", parallel.Ring()),
    ("cp8", parallel.Ring()),
    ("fsdp2xcp2xtp2", parallel.Ring()),
    ("dp2xcp4", parallel.Ulysses()),
]


@pytest.mark.parametrize(
    "name, method", LAYOUTS, ids=[f"{n}-{type(m).__name__.lower()}" for n, m in LAYOUTS]
)
def test_context_layouts_train_as_one_device(name, method, reference):
    trainer = dp.Trainer(_loss(method), twin_optimizer(), layout=dp.Layout.parse(name))
    state = trainer.init(_params(boxed=True), jax.random.key(0))
    for b in _batches():
        state, _ = trainer.step(state, b)
    got = trainer.host_params(state)
    for copy in ("adam", "sgd"):
        assert max_rel_diff(got[copy], reference[copy]) <= 1e-5, copy


class _Unsupported(nn.Module):
    sequence_parallel: bool = False
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train=False):
        h = nn.Embed(VOCAB, WIDTH)(x)
        attn = pnn.ParallelSelfAttention(
            HEADS, use_bias=False, sequence_parallel=self.sequence_parallel,
            dropout_rate=self.dropout,
        )  # fmt: skip
        return attn(h, deterministic=not train)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sequence_parallel": True}, r"sequence_parallel=True splits the sequence"),
        ({"dropout": 0.1}, r"dropout of the attention weights is not supported with a context"),
    ],
)
def test_what_context_attention_does_not_do_is_refused(kwargs, match):
    model = _Unsupported(**kwargs)
    params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]

    def loss(p, batch, rng):
        out = model.apply({"params": p}, batch["x"], train=True, rngs={"dropout": rng})
        return jnp.mean(out**2), {}

    trainer = dp.Trainer(loss, optax.sgd(0.1), layout=dp.Layout(replicate=2, context=2, tensor=2))
    state = trainer.init(params, jax.random.key(0))
    with pytest.raises(ValueError, match=match):
        trainer.step(state, _batches()[0])
