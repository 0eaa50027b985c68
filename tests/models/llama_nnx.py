"""A small Llama-family decoder in flax nnx, written the way nnx users write one.

Every parameter carries logical sharding names (MaxText's vocabulary: ``vocab``, ``embed``,
``heads``, ``kv_heads``, ``kv``, ``mlp``) in its ``out_sharding`` metadata, set through
``nnx.with_partitioning`` on the initializer. Nothing here knows about a mesh.

flax 0.12 shards a Variable as it is created when that Variable has sharding metadata
(``flax_always_shard_variable`` defaults to True), so construction needs one of:

- no mesh at all (one device)::

      with nnx.use_eager_sharding(False):
          model = Llama(LlamaConfig(), rngs=nnx.Rngs(0))

  Without the context manager, construction raises ``ValueError: An auto mesh context or
  metadata is required if creating a variable with annotation out_sharding=('vocab', 'embed')``.

- a mesh and the logical-to-mesh rules (what MaxText does)::

      with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
          model = Llama(LlamaConfig(), rngs=nnx.Rngs(0))

Shapes: ``tokens``, ``positions`` and ``segment_ids`` are ``(B, T)`` int32; the model returns
float32 logits ``(B, T, vocab)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model hyperparameters.

    Attributes:
        vocab_size: number of tokens; the embedding is tied to the output projection.
        d_model: width of the residual stream.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention: ``n_heads % n_kv_heads == 0``).
        head_dim: width of one head.
        mlp_dim: hidden width of the SwiGLU MLP.
        n_layers: number of decoder blocks.
        rope_theta: RoPE base frequency.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 8
    mlp_dim: int = 64
    n_layers: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (split-half form) of ``x`` ``(B, T, heads, head_dim)``."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * inv_freq  # (B, T, half)
    sin = jnp.sin(angle)[:, :, None, :]
    cos = jnp.cos(angle)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """Causal mask within each segment, shape ``(B, 1, T, T)`` (broadcast over heads)."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None, :, :]


def _dense_init(names: tuple[str, ...]) -> nnx.Initializer:
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = nnx.LinearGeneral(
            d, (n, h), use_bias=False, kernel_init=_dense_init(("embed", "heads", "kv")), rngs=rngs
        )
        kv_init = _dense_init(("embed", "kv_heads", "kv"))
        self.k = nnx.LinearGeneral(d, (k, h), use_bias=False, kernel_init=kv_init, rngs=rngs)
        self.v = nnx.LinearGeneral(d, (k, h), use_bias=False, kernel_init=kv_init, rngs=rngs)
        self.o = nnx.LinearGeneral(
            (n, h),
            d,
            axis=(-2, -1),
            use_bias=False,
            kernel_init=_dense_init(("heads", "kv", "embed")),
            rngs=rngs,
        )

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        q = apply_rope(self.q(x), positions, self.cfg.rope_theta)  # (B, T, N, H)
        k = apply_rope(self.k(x), positions, self.cfg.rope_theta)  # (B, T, K, H)
        v = self.v(x)
        if segment_ids is None:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            out = jax.nn.dot_product_attention(q, k, v, mask=attention_mask(segment_ids))
        return self.o(out)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, m = cfg.d_model, cfg.mlp_dim
        self.gate = nnx.Linear(
            d, m, use_bias=False, kernel_init=_dense_init(("embed", "mlp")), rngs=rngs
        )
        self.up = nnx.Linear(
            d, m, use_bias=False, kernel_init=_dense_init(("embed", "mlp")), rngs=rngs
        )
        self.down = nnx.Linear(
            m, d, use_bias=False, kernel_init=_dense_init(("mlp", "embed")), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def _rms_norm(cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(
        cfg.d_model,
        epsilon=cfg.norm_eps,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
        rngs=rngs,
    )


class Block(nnx.Module):
    """Pre-norm decoder block: attention and MLP, each on a residual."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.attention_norm = _rms_norm(cfg, rngs)
        self.attention = Attention(cfg, rngs=rngs)
        self.mlp_norm = _rms_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(
        self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        h = h + self.attention(self.attention_norm(h), positions, segment_ids)
        return h + self.mlp(self.mlp_norm(h))


class Llama(nnx.Module):
    """Decoder-only Llama: tied embedding, ``n_layers`` blocks, final RMSNorm."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            embedding_init=nnx.with_partitioning(
                nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
                ("vocab", "embed"),
            ),
            rngs=rngs,
        )
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = _rms_norm(cfg, rngs)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h, positions, segment_ids)
        return self.embed.attend(self.final_norm(h)).astype(jnp.float32)
