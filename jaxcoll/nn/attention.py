"""ParallelSelfAttention: multi-head self-attention, its heads split over the tensor axis."""

from __future__ import annotations

from typing import cast

import jax
import jax.numpy as jnp
from flax import linen
from flax.typing import Dtype, Initializer
from jax import lax

from .. import parallel
from .._core import roles
from .._core.roles import Role
from .._core.vma import cast_varying
from . import _params


# -------------------------------------------------------------------------- the attention
class ParallelSelfAttention(linen.Module):
    """Multi-head self-attention, its heads split over ``axis_name`` (Megatron's attention).

    Equivalent to the dense layer (flax's ``MultiHeadDotProductAttention(num_heads)`` on
    ``(x, x)`` with a causal mask, whose param tree it shares) on the whole params::

        def attention(x):                                  # x: (..., S, d)
            q, k, v = (einsum("...sd,dhk->...shk", x, p.kernel) + p.bias
                       for p in (query, key, value))      # (..., S, H, hd)
            w = softmax(einsum("...qhk,...shk->...hqs", q / sqrt(hd), k)
                        masked to s <= q if causal)        # (..., H, S, S)
            o = einsum("...hqs,...shk->...qhk", dropout(w), v)
            return einsum("...qhk,hko->...qo", o, out.kernel) + out.bias

    Params, declared whole and boxed by ``flax.linen.with_partitioning`` with these partition
    names (``d = x.shape[-1]``, ``H = num_heads``, ``hd = qkv_features / H``,
    ``o = out_features``; a contiguous split of the heads dim gives each rank whole heads)::

        query|key|value/kernel  (d, H, hd)  (None, axis_name, None)  column-parallel
        query|key|value/bias    (H, hd)     (axis_name, None)
        out/kernel              (H, hd, o)  (axis_name, None, None)  row-parallel
        out/bias                (o,)        (None,)                  replicated, added once

    Called where ``axis_name`` is bound (inside ``jax.shard_map``; params passed with
    ``in_specs=flax.linen.get_partition_spec(variables)``), each rank owns ``H/n`` whole heads:
    the q/k/v projections are column-parallel (:func:`jaxcoll.parallel.column_parallel`, no
    communication), the attention of its heads is local, and the output projection is
    row-parallel (:func:`jaxcoll.parallel.row_parallel`), its bias added once after the sum.
    Where ``axis_name`` is not bound (outside ``shard_map``, or ``axis_name=None``) the same
    functions are the dense layer on whole params, with no collective.

    Communication per call, forward: ONE all-reduce of the output, ``(..., S, o)``. The
    backward adds its mirror, ONE all-reduce of the input's cotangent (q, k and v share one
    varying copy of the input, so their three cotangents are summed locally first; jax
    inserts the all-reduce under ``shard_map``'s default ``check_vma=True``). With
    ``sequence_parallel=True``: one all-gather of the input's rows and one reduce-scatter of
    the output's, and in the backward one reduce-scatter, one all-gather and, with
    ``use_bias``, an all-reduce of the output bias's gradient ``(o,)``.

    Attributes:
        num_heads: the number of heads H; must divide by the size of ``axis_name``.
        axis_name: the mesh axis the heads are split over (a role: a ``dp.Trainer``'s layout
            gives it); None for the dense layer everywhere.
        use_bias: give the four projections biases.
        causal: mask each position's attention to itself and the positions before it.
        dropout_rate: dropout of the attention weights, applied when called with
            ``deterministic=False`` (an rng ``"dropout"`` is then needed). Head h's mask is
            drawn from ``jax.random.fold_in(rng, h)``, so the split layer drops exactly what
            the dense layer drops.
        qkv_features: the width of q, k and v, ``H * hd`` (None: the input width); must
            divide by ``num_heads``.
        out_features: the output width (None: the input width).
        sequence_parallel: under ``shard_map``, the input is this rank's contiguous ``1/n`` of
            the sequence dim (-2) and so is the output. Ignored in dense mode.
        kernel_init: initializer of the four kernels (called on the whole, flat kernel:
            ``(d, H*hd)`` and ``(H*hd, o)``, as flax's ``DenseGeneral`` does).
        bias_init: initializer of the four biases.
        dtype: the computation dtype (None: from the input and params).
        param_dtype: the params' dtype.
        fused_qkv: one kernel for q, k and v, ``qkv/kernel`` of shape ``(d, 3, H, hd)``
            (split over its heads dim, ``(None, None, axis_name, None)``) and ``qkv/bias``
            ``(3, H, hd)``, instead of three: nanoGPT's and GPT-2's ``c_attn`` as it is,
            reshaped (``c_attn.weight.T.reshape(d, 3, H, hd)`` from torch; its output is
            q, k, v in that order, each head's ``hd`` columns together).
        out_kernel_init: the output projection's own initializer (None: ``kernel_init``),
            e.g. GPT-2's ``normal(0.02 / sqrt(2 * n_layer))`` for ``c_proj``.
        context: how attention runs where the role ``"context"`` is bound (a ``dp.Layout``
            with ``context=``: the input is this device's part of the sequence, in the
            load-balanced order): :class:`~jaxcoll.parallel.Ring` (ring attention) or
            :class:`~jaxcoll.parallel.Ulysses` (heads divisible by the context axis, after
            any tensor split); see :func:`~jaxcoll.parallel.context_attention`.

    Called as ``module.apply(variables, x, deterministic=True)`` with ``x`` of shape
    ``(..., S, d)``, it returns the output, ``(..., S, o)``.

    Note:
        Initialise outside ``jax.shard_map`` (whole params). Under ``shard_map`` ``init``
        gives each rank its slice of the same whole initial values, computed whole on every
        rank. Boxed (``nn.Partitioned``) and plain params are both accepted at apply.

    Example (2 devices)::

        >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("tensor",))
        >>> attn = ParallelSelfAttention(num_heads=4)
        >>> x = jnp.ones((2, 10, 32))  # (batch, sequence, features)
        >>> variables = attn.init(jax.random.key(0), x)
        >>> specs = flax.linen.get_partition_spec(variables)
        >>> specs["params"]["query"]["kernel"], specs["params"]["out"]["kernel"]
        (P(None, 'tensor', None), P('tensor', None, None))
        >>> split = jax.jit(jax.shard_map(attn.apply, mesh=mesh, in_specs=(specs, P()),
        ...                               out_specs=P()))
        >>> bool(jnp.allclose(split(variables, x), attn.apply(variables, x), atol=1e-5))
        True
    """

    num_heads: int
    axis_name: str | None = Role.TENSOR
    use_bias: bool = True
    causal: bool = True
    dropout_rate: float = 0.0
    qkv_features: int | None = None
    out_features: int | None = None
    sequence_parallel: bool = False
    kernel_init: Initializer = _params.default_kernel_init
    bias_init: Initializer = linen.initializers.zeros_init()
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    fused_qkv: bool = False
    out_kernel_init: Initializer | None = None
    context: parallel.Ring | parallel.Ulysses = parallel.Ring()  # noqa: RUF009 - a frozen value

    @linen.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        axis = roles.axis(self.axis_name)  # the layout's tensor axis, where one binds
        api = _params.where(self)
        heads, head_dim, out = self._sizes(api, x)
        ranks = _params.split_ranks(self, api, "num_heads", heads, axis)
        sp = self.sequence_parallel and ranks is not None
        pairs, wo, bo = self._declare(jnp.shape(x)[-1], heads, head_dim, out, ranks)
        flat = [p for pair in pairs for p in pair]
        promoted = linen.dtypes.promote_dtype(x, *flat, wo, bo, dtype=self.dtype)
        x, wo, bo = promoted[0], promoted[-2], promoted[-1]
        kernels = cast(list[jax.Array], promoted[1:-2:2])  # a kernel is always there
        pairs = list(zip(kernels, promoted[2:-2:2], strict=True))
        q, k, v = self._project(x, pairs, axis, ranks, sp)
        if parallel.is_bound(Role.CONTEXT):  # the sequence split over the layout's context axis
            o = self._context_attention(api, q, k, v, sp, deterministic)
        else:
            o = self._local_attention(q, k, v, axis, ranks, deterministic)
        # the output projection of o (..., S, h, hd) by wo (h, hd, out): row-parallel, one
        # all-reduce (a reduce-scatter of the sequence dim with sequence_parallel); dense
        # where no tensor axis is bound
        return parallel.row_parallel(o, wo, axis, bo, scatter=sp, dim=-2)

    def _sizes(self, api: str, x: jax.Array) -> tuple[int, int, int]:
        """The number of heads, the head width and the output width, checked."""
        heads = _params.positive_int(api, "num_heads", self.num_heads)
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(
                f"{api}: dropout_rate={self.dropout_rate!r} must be in [0, 1): the fraction "
                f"of attention weights dropped."
            )
        if jnp.ndim(x) < 2:
            raise ValueError(
                f"{api}: x has shape {jnp.shape(x)}; it needs a sequence dim and a feature "
                f"dim, (..., sequence, features)."
            )
        d = jnp.shape(x)[-1]
        qkv = d if self.qkv_features is None else self.qkv_features
        qkv = _params.positive_int(api, "qkv_features", qkv)
        out = d if self.out_features is None else self.out_features
        out = _params.positive_int(api, "out_features", out)
        if qkv % heads:
            which = "qkv_features" if self.qkv_features is not None else "the input width"
            raise ValueError(
                f"{api}: {which} {qkv} does not split into num_heads={heads} heads. Pick a "
                f"number of heads that divides {qkv}, or pass qkv_features= a multiple of "
                f"{heads}."
            )
        return heads, qkv // heads, out

    def _declare(
        self, d: int, heads: int, head_dim: int, out: int, ranks: int | None
    ) -> tuple[list[tuple[jax.Array, jax.Array | None]], jax.Array, jax.Array | None]:
        """The projections' params (this rank's slices where ``ranks`` is set): the q, k and
        v kernels and biases (one fused pair with ``fused_qkv``), the output kernel and bias."""
        q_shape, bias_shape = (d, heads, head_dim), (heads, head_dim)
        if self.fused_qkv:  # one (d, 3, H, hd) kernel: nanoGPT's c_attn, (d, 3d), reshaped
            pairs = [
                _params.linear(
                    self, "qkv", ranks, (d, 3) + bias_shape, 2, (3,) + bias_shape, 1,
                    split_arg="num_heads",
                )
            ]  # fmt: skip
        else:
            pairs = [
                _params.linear(self, name, ranks, q_shape, 1, bias_shape, 0, split_arg="num_heads")
                for name in ("query", "key", "value")
            ]
        wo, bo = _params.linear(
            self,
            "out",
            ranks,
            (heads, head_dim, out),
            0,
            (out,),
            None,
            fan_in_dims=2,
            split_arg="num_heads",
            kernel_init=self.out_kernel_init,
        )
        return pairs, wo, bo

    def _project(
        self,
        x: jax.Array,
        pairs: list[tuple[jax.Array, jax.Array | None]],
        axis: str | None,
        ranks: int | None,
        sp: bool,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k and v, ``(..., S, h, hd)`` each for this rank's ``h`` heads: column-parallel
        (no communication), each kernel contracted in its own shape (a reshaped kernel would
        be a new value that a rematerialisation policy keeping everything but the gathered
        params, FSDP's, saves for every layer)."""
        if sp:  # this rank's rows of the sequence -> the whole sequence
            x = parallel.sequence_gather(x, axis, dim=-2)
        elif ranks is not None:
            # Megatron's "f", once for q, k and v: the backward sums their three cotangents
            # of x here and then over the ranks in ONE all-reduce, not one per projection.
            x = cast_varying(x, (axis,))
        if self.fused_qkv:  # (..., S, 3, h, hd): one matmul for q, k and v
            fused = parallel.column_parallel(x, *pairs[0])
            return fused[..., 0, :, :], fused[..., 1, :, :], fused[..., 2, :, :]
        q, k, v = (parallel.column_parallel(x, w, b) for w, b in pairs)
        return q, k, v

    def _context_attention(
        self, api: str, q: jax.Array, k: jax.Array, v: jax.Array, sp: bool, deterministic: bool
    ) -> jax.Array:
        """Attention of this device's part of the sequence over the whole of it, split over
        the layout's context axis (:func:`jaxcoll.parallel.context_attention`)."""
        if sp:
            raise ValueError(
                f"{api}: sequence_parallel=True splits the sequence over the tensor axis, "
                f"and the layout's context axis splits it already; pass "
                f"sequence_parallel=False with a context axis."
            )
        if self.dropout_rate > 0.0 and not deterministic:
            raise ValueError(
                f"{api}: dropout of the attention weights is not supported with a context "
                f"axis (the weights are never whole on one device); pass dropout_rate=0."
            )
        return parallel.context_attention(
            q, k, v, Role.CONTEXT, method=self.context, causal=self.causal
        )

    def _local_attention(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        axis: str | None,
        ranks: int | None,
        deterministic: bool,
    ) -> jax.Array:
        """Attention of this rank's heads over the sequence it holds whole: no communication."""
        head_dim, local_heads = q.shape[-1], q.shape[-2]
        logits = jnp.einsum("...qhk,...shk->...hqs", q / jnp.sqrt(head_dim).astype(q.dtype), k)
        seq = logits.shape[-1]
        if self.causal:
            allowed = jnp.tril(jnp.ones((seq, seq), dtype=bool))
            logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        if self.dropout_rate > 0.0 and not deterministic:
            first = 0 if ranks is None else lax.axis_index(axis) * local_heads
            probs = _dropout_heads(
                probs,
                self.make_rng("dropout"),
                first + jnp.arange(local_heads),
                self.dropout_rate,
            )
        return jnp.einsum("...hqs,...shk->...qhk", probs, v)


def _dropout_heads(weights: jax.Array, rng: jax.Array, heads: jax.Array, rate: float) -> jax.Array:
    """Dropout of ``weights`` (..., h, S, S) whose head i is global head ``heads[i]``: that
    head's mask is drawn from ``fold_in(rng, heads[i])``, the same in the dense layer and on
    the rank that owns the head."""
    per_head = weights.shape[:-3] + weights.shape[-2:]

    def keep_of(head: jax.Array) -> jax.Array:
        return jax.random.bernoulli(jax.random.fold_in(rng, head), 1.0 - rate, per_head)

    keep = jnp.moveaxis(jax.vmap(keep_of)(heads), 0, -3)
    return jnp.where(keep, weights / (1.0 - rate), jnp.zeros_like(weights))
