"""The same Llama-family decoder in flax linen, written EasyLM-style.

The modules carry no sharding annotations. Sharding is stated beside the model, as EasyLM and
t5x users state it: ``PARTITION_RULES``, regular expressions over the ``/``-joined parameter
path, each mapped to a ``PartitionSpec`` over the user's own mesh axes ``"fsdp"`` and ``"mp"``
(Megatron tensor parallelism: q/k/v/gate/up column-parallel, o/down row-parallel, the
embedding's vocabulary split over ``"mp"``; everything else replicated).

Attention projections are plain ``nn.Dense`` layers with flat kernels, reshaped into heads in
the forward pass, as EasyLM does: q ``(d_model, n_heads * head_dim)``, k and v
``(d_model, n_kv_heads * head_dim)``, o ``(n_heads * head_dim, d_model)``.

Usage::

    module = Llama(LlamaConfig())
    params = module.init(jax.random.key(0), tokens, positions)["params"]
    logits = apply(params, tokens, positions)            # (B, T, vocab) float32
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model hyperparameters (the same fields and defaults as the nnx model's)."""

    vocab_size: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 8
    mlp_dim: int = 64
    n_layers: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


# (regex over "/"-joined param path, PartitionSpec); the first match wins.
PARTITION_RULES: tuple[tuple[str, P], ...] = (
    (r"embed/embedding", P("mp", "fsdp")),
    (r"attention/(q|k|v)/kernel", P("fsdp", "mp")),
    (r"attention/o/kernel", P("mp", "fsdp")),
    (r"mlp/(gate|up)/kernel", P("fsdp", "mp")),
    (r"mlp/down/kernel", P("mp", "fsdp")),
    (r".*scale", P(None)),
    (r".*", P(None)),
)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (split-half form) of ``x`` ``(B, T, heads, head_dim)``."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * inv_freq
    sin = jnp.sin(angle)[:, :, None, :]
    cos = jnp.cos(angle)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x.shape
        q = nn.Dense(cfg.n_heads * cfg.head_dim, use_bias=False, name="q")(x)
        k = nn.Dense(cfg.n_kv_heads * cfg.head_dim, use_bias=False, name="k")(x)
        v = nn.Dense(cfg.n_kv_heads * cfg.head_dim, use_bias=False, name="v")(x)
        q = apply_rope(q.reshape(b, t, cfg.n_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = apply_rope(k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = v.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        if segment_ids is None:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))
            same = segment_ids[:, :, None] == segment_ids[:, None, :]
            mask = (same & causal)[:, None, :, :]
            out = jax.nn.dot_product_attention(q, k, v, mask=mask)
        out = out.reshape(b, t, cfg.n_heads * cfg.head_dim)
        return nn.Dense(cfg.d_model, use_bias=False, name="o")(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = nn.Dense(self.cfg.mlp_dim, use_bias=False, name="gate")(x)
        up = nn.Dense(self.cfg.mlp_dim, use_bias=False, name="up")(x)
        return nn.Dense(self.cfg.d_model, use_bias=False, name="down")(nn.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm decoder block: attention and MLP, each on a residual."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(
        self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        eps = self.cfg.norm_eps
        a = nn.RMSNorm(epsilon=eps, name="attention_norm")(h)
        h = h + Attention(self.cfg, name="attention")(a, positions, segment_ids)
        m = nn.RMSNorm(epsilon=eps, name="mlp_norm")(h)
        return h + MLP(self.cfg, name="mlp")(m)


class Llama(nn.Module):
    """Decoder-only Llama: tied embedding, ``n_layers`` blocks (``layers_0`` ...), final norm."""

    cfg: LlamaConfig

    def setup(self):
        self.embed = nn.Embed(self.cfg.vocab_size, self.cfg.d_model)
        self.layers = [Block(self.cfg) for _ in range(self.cfg.n_layers)]
        self.final_norm = nn.RMSNorm(epsilon=self.cfg.norm_eps)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h, positions, segment_ids)
        return self.embed.attend(self.final_norm(h)).astype(jnp.float32)


def apply(
    params: Any,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    cfg: LlamaConfig | None = None,
) -> jax.Array:
    """Logits ``(B, T, vocab)`` float32 of ``Llama(cfg)`` with ``params`` (the "params" tree).

    Args:
        params: the ``"params"`` collection, e.g. from ``init``.
        tokens: ``(B, T)`` int32 token ids.
        positions: ``(B, T)`` int32 positions (RoPE).
        segment_ids: optional ``(B, T)`` int32 ids of packed documents; attention stays within
            a document.
        cfg: the model's config; ``LlamaConfig()`` when omitted.
    """
    module = Llama(cfg or LlamaConfig())
    return cast(jax.Array, module.apply({"params": params}, tokens, positions, segment_ids))


def init(key: jax.Array, cfg: LlamaConfig | None = None, *, seq: int = 16) -> Any:
    """Fresh parameters (the ``"params"`` tree) for ``Llama(cfg)`` (``LlamaConfig()`` if None)."""
    tokens = jnp.zeros((1, seq), jnp.int32)
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    return Llama(cfg or LlamaConfig()).init(key, tokens, positions)["params"]
