"""ParallelSelfAttention: multi-head self-attention (grouped-query, RoPE), its heads split over
the tensor axis.

Example (4 devices): Llama's attention, 8 query heads, 2 key/value heads and RoPE, split over
more ranks than it has key/value heads::

    >>> mesh = jax.sharding.Mesh(jax.devices()[:4], ("tensor",))
    >>> x = jnp.ones((2, 10, 32))  # (batch, sequence, features)
    >>> llama = ParallelSelfAttention(num_heads=8, num_kv_heads=2, rope_theta=1e4,
    ...                               use_bias=False)
    >>> with jax.set_mesh(mesh):  # 4 ranks > 2 kv heads: K and V declared whole
    ...     variables = jax.jit(llama.init)(jax.random.key(0), x)
    >>> specs = flax.linen.get_partition_spec(variables)
    >>> specs["params"]["key"]["kernel"], specs["params"]["query"]["kernel"]
    (P(None, None, None), P(None, 'tensor', None))
    >>> split = jax.jit(jax.shard_map(llama.apply, mesh=mesh, in_specs=(specs, P()),
    ...                               out_specs=P()))
    >>> bool(jnp.allclose(split(variables, x), jax.jit(llama.apply)(variables, x), atol=1e-5))
    True
"""

from __future__ import annotations

import numbers
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
from ._rope import rope

Pair = tuple[jax.Array, jax.Array | None]  # a projection's kernel and bias


# -------------------------------------------------------------------------- the attention
class ParallelSelfAttention(linen.Module):
    """Multi-head self-attention, its heads split over ``axis_name`` (Megatron's attention);
    grouped-query attention with ``num_kv_heads``, rotary position embedding with
    ``rope_theta`` (Llama's attention, without its projections' biases: ``use_bias=False``).

    Equivalent to the dense layer (flax's ``MultiHeadDotProductAttention(num_heads)`` on
    ``(x, x)`` with a causal mask, whose param tree it shares, where ``num_kv_heads`` and
    ``rope_theta`` are None) on the whole params::

        def attention(x, positions):                       # x: (..., S, d)
            q, k, v = (einsum("...sd,dhk->...shk", x, p.kernel) + p.bias
                       for p in (query, key, value))      # (..., S, H or Hkv, hd)
            if rope_theta is not None:                     # split-half RoPE of q and k
                q, k = rope(q, positions), rope(k, positions)
            k, v = repeat(k, H // Hkv, axis=-2), repeat(v, H // Hkv, axis=-2)
            w = softmax(einsum("...qhk,...shk->...hqs", q / sqrt(hd), k)
                        masked to s <= q if causal)        # (..., H, S, S)
            o = einsum("...hqs,...shk->...qhk", dropout(w), v)
            return einsum("...qhk,hko->...qo", o, out.kernel) + out.bias

    (query head ``h`` uses key/value head ``h // (H / Hkv)``, as ``jax.nn.dot_product_attention``
    groups them; ``rope`` rotates each head's dims ``i`` and ``i + hd/2`` by the angle
    ``position * rope_theta ** (-2i / hd)``).

    Params, declared whole and boxed by ``flax.linen.with_partitioning`` with these partition
    names (``d = x.shape[-1]``, ``H = num_heads``, ``Hkv = num_kv_heads``,
    ``hd = qkv_features / H``, ``o = out_features``; a contiguous split of the heads dim gives
    each rank whole heads)::

        query/kernel        (d, H, hd)    (None, axis_name, None)  column-parallel
        query/bias          (H, hd)       (axis_name, None)
        key|value/kernel    (d, Hkv, hd)  (None, axis_name, None)  or whole, see below
        key|value/bias      (Hkv, hd)     (axis_name, None)
        out/kernel          (H, hd, o)    (axis_name, None, None)  row-parallel
        out/bias            (o,)          (None,)                  replicated, added once

    Called where ``axis_name`` is bound (inside ``jax.shard_map``; params passed with
    ``in_specs=flax.linen.get_partition_spec(variables)``), each of the ``n`` ranks owns
    ``H/n`` whole query heads: the q/k/v projections are column-parallel
    (:func:`jaxcoll.parallel.column_parallel`, no communication), the attention of its heads
    is local, and the output projection is row-parallel
    (:func:`jaxcoll.parallel.row_parallel`), its bias added once after the sum. The key/value
    heads follow the query heads: where ``n`` divides ``Hkv`` each rank owns ``Hkv/n`` of
    them (split as above); where ``n`` is a multiple of ``Hkv`` (more ranks than key/value
    heads: multi-query attention, ``Hkv = 1``), K and V are declared whole (names all None,
    replicated over the ranks) and rank ``r`` uses the one key/value head its query heads
    share, ``(r * H/n) // (H/Hkv)`` (Megatron's and MaxText's answer); their gradients are
    summed over the ranks by the backward. Any other ``n`` is refused. The layer picks the
    declaration by the tensor degree it knows at ``init``: under ``jax.shard_map`` the
    axis's, under ``jax.set_mesh(mesh)`` that mesh's; otherwise it declares K and V split
    (whole where ``Hkv = 1``), so for ``n > Hkv > 1`` initialise under ``jax.set_mesh``.
    Where ``axis_name`` is not bound (outside ``shard_map``, or ``axis_name=None``) the same
    functions are the dense layer on whole params, with no collective.

    Communication per call, forward: ONE all-reduce of the output, ``(..., S, o)``. The
    backward adds its mirror, ONE all-reduce of the input's cotangent (q, k and v share one
    varying copy of the input, so their three cotangents are summed locally first; jax
    inserts the all-reduce under ``shard_map``'s default ``check_vma=True``), and for K and V
    declared whole, an all-reduce of their params' gradients. With
    ``sequence_parallel=True``: one all-gather of the input's rows and one reduce-scatter of
    the output's, and in the backward one reduce-scatter, one all-gather and, with
    ``use_bias``, an all-reduce of the output bias's gradient ``(o,)``.

    Attributes:
        num_heads: the number of query heads H; must divide by the size of ``axis_name``.
        axis_name: the mesh axis the heads are split over (a role: a ``dp.Trainer``'s layout
            gives it); None for the dense layer everywhere.
        use_bias: give the four projections biases.
        causal: mask each position's attention to itself and the positions before it.
        dropout_rate: dropout of the attention weights, applied when called with
            ``deterministic=False`` (an rng ``"dropout"`` is then needed). Head h's mask is
            drawn from ``jax.random.fold_in(rng, h)``, so the split layer drops exactly what
            the dense layer drops.
        qkv_features: the width of q, ``H * hd`` (None: the input width); must divide by
            ``num_heads``. K and V are ``Hkv * hd`` wide.
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
            q, k, v in that order, each head's ``hd`` columns together). Not with
            ``num_kv_heads < num_heads``.
        out_kernel_init: the output projection's own initializer (None: ``kernel_init``),
            e.g. GPT-2's ``normal(0.02 / sqrt(2 * n_layer))`` for ``c_proj``.
        context: how attention runs where the role ``"context"`` is bound (a ``dp.Layout``
            with ``context=``: the input is this device's part of the sequence, in the
            load-balanced order): :class:`~jaxcoll.parallel.Ring` (ring attention) or
            :class:`~jaxcoll.parallel.Ulysses` (heads divisible by the context axis, after
            any tensor split); see :func:`~jaxcoll.parallel.context_attention`, which gets
            K and V with their ``Hkv`` heads (this rank's).
        num_kv_heads: the key/value heads Hkv (grouped-query attention: each group of
            ``H/Hkv`` consecutive query heads shares one); None: ``num_heads`` (multi-head).
            ``num_heads`` must be a multiple of it.
        rope_theta: the base of the rotary position embedding of q and k (Llama's 10000,
            500000 for Llama 3; split-half form); None: no position embedding.

    Called as ``module.apply(variables, x, positions, deterministic=True)`` with ``x`` of
    shape ``(..., S, d)`` and, with ``rope_theta``, optionally ``positions``: the integer
    positions of ``x``'s tokens, ``(..., S)`` (broadcast against ``x``'s leading dims; a
    packed row's positions restart in each document). They default to the token positions:
    ``arange(S)``, and where the context role is bound, this device's tokens' positions in
    the whole sequence (:func:`jaxcoll.parallel.context_positions`). With
    ``sequence_parallel``, ``positions`` are this rank's rows' (gathered with the input). It
    returns the output, ``(..., S, o)``.

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
    num_kv_heads: int | None = None
    rope_theta: float | None = None

    @linen.compact
    def __call__(
        self, x: jax.Array, positions: jax.Array | None = None, *, deterministic: bool = True
    ) -> jax.Array:
        axis = roles.axis(self.axis_name)  # the layout's tensor axis, where one binds
        api = _params.where(self)
        heads, kv_heads, head_dim, out = self._sizes(api, x)
        ranks = _params.split_ranks(self, api, "num_heads", heads, axis)
        kv_split = self._kv_split(api, kv_heads, ranks, axis)
        sp = self.sequence_parallel and ranks is not None
        positions = self._positions(api, x, positions, axis, sp)
        d = jnp.shape(x)[-1]
        pairs, wo, bo = self._declare(d, (heads, kv_heads, head_dim, out), ranks, kv_split)
        flat = [p for pair in pairs for p in pair]
        promoted = linen.dtypes.promote_dtype(x, *flat, wo, bo, dtype=self.dtype)
        x, wo, bo = promoted[0], promoted[-2], promoted[-1]
        kernels = cast(list[jax.Array], promoted[1:-2:2])  # a kernel is always there
        pairs = list(zip(kernels, promoted[2:-2:2], strict=True))
        if ranks is not None and not kv_split:  # K and V whole: this rank's key/value head
            pairs[1:] = [
                _own_kv_head(p, axis, heads // ranks, heads // kv_heads) for p in pairs[1:]
            ]
        q, k, v = self._project(x, pairs, axis, ranks, sp)
        if positions is not None:  # RoPE of q and k, at each token's position
            theta = float(cast(float, self.rope_theta))  # set: positions are only made for it
            q, k = rope(q, positions, theta), rope(k, positions, theta)
        if parallel.is_bound(Role.CONTEXT):  # the sequence split over the layout's context axis
            o = self._context_attention(api, q, k, v, sp, deterministic)
        else:
            o = self._local_attention(q, k, v, axis, ranks, deterministic)
        # the output projection of o (..., S, h, hd) by wo (h, hd, out): row-parallel, one
        # all-reduce (a reduce-scatter of the sequence dim with sequence_parallel); dense
        # where no tensor axis is bound
        return parallel.row_parallel(o, wo, axis, bo, scatter=sp, dim=-2)

    def _sizes(self, api: str, x: jax.Array) -> tuple[int, int, int, int]:
        """The query and key/value heads, the head width and the output width, checked."""
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
        kv_heads = self._kv_heads(api, heads)
        _check_rope(api, self.rope_theta, qkv // heads)
        return heads, kv_heads, qkv // heads, out

    def _kv_heads(self, api: str, heads: int) -> int:
        """The key/value heads, checked against the query heads and ``fused_qkv``."""
        if self.num_kv_heads is None:
            return heads
        kv_heads = _params.positive_int(api, "num_kv_heads", self.num_kv_heads)
        if heads % kv_heads:
            raise ValueError(
                f"{api}: num_heads={heads} is not a multiple of num_kv_heads={kv_heads}: each "
                f"key/value head serves a group of num_heads / num_kv_heads query heads. Pick "
                f"a number of key/value heads that divides {heads}."
            )
        if self.fused_qkv and kv_heads != heads:
            raise ValueError(
                f"{api}: fused_qkv=True holds q, k and v with num_heads={heads} heads each, "
                f"so num_kv_heads={kv_heads} cannot be; pass fused_qkv=False for "
                f"grouped-query attention (three kernels, K and V with {kv_heads} heads)."
            )
        return kv_heads

    def _kv_split(self, api: str, kv_heads: int, ranks: int | None, axis: str | None) -> bool:
        """Whether K and V are split over ``axis`` (each of its ``n`` ranks owning
        ``Hkv/n`` heads) rather than declared whole (each rank slicing the one it uses): by
        the ``n`` known here (bound, or at ``init`` the mesh of ``jax.set_mesh``), split
        where it divides ``Hkv``, whole where it is a multiple of ``Hkv``; not known, split
        unless ``Hkv = 1``."""
        n = ranks if ranks is not None or not self.is_initializing() else _params.mesh_size(axis)
        if n is None:
            return kv_heads > 1
        if kv_heads % n == 0:
            return True
        if n % kv_heads == 0:
            return False
        raise ValueError(
            f"{api}: num_kv_heads={kv_heads} key/value heads cannot follow the query heads "
            f"over the {n} ranks of mesh axis {axis!r}: a rank needs whole key/value heads "
            f"({n} dividing num_kv_heads) or one it shares with other ranks ({n} a multiple "
            f"of num_kv_heads). Pick num_kv_heads that divides or is divisible by {n}, or "
            f"split over an axis of such a size."
        )

    def _positions(
        self, api: str, x: jax.Array, positions: jax.Array | None, axis: str | None, sp: bool
    ) -> jax.Array | None:
        """The positions RoPE rotates q and k by (None without ``rope_theta``): those given,
        checked (gathered over ``axis`` with sequence parallelism), else the tokens'."""
        seq = jnp.shape(x)[-2]
        if self.rope_theta is None:
            if positions is not None:
                raise ValueError(
                    f"{api}: positions were given, but the layer has no position embedding "
                    f"to use them (rope_theta=None); pass rope_theta= (e.g. 10000.0) for "
                    f"RoPE, or call it without positions."
                )
            return None
        if positions is None:
            if parallel.is_bound(Role.CONTEXT):  # this device's tokens' places in the sequence
                return parallel.context_positions(seq, Role.CONTEXT)
            return jnp.arange(seq * (int(lax.axis_size(axis)) if sp else 1))
        if not jnp.issubdtype(jnp.result_type(positions), jnp.integer):
            raise TypeError(
                f"{api}: positions must be integers (the tokens' positions), got dtype "
                f"{jnp.result_type(positions)} instead."
            )
        if jnp.ndim(positions) < 1 or jnp.shape(positions)[-1] != seq:
            raise ValueError(
                f"{api}: positions has shape {jnp.shape(positions)}, where (..., {seq}) is "
                f"expected: one position per token of x {jnp.shape(x)}."
            )
        return parallel.sequence_gather(positions, axis, dim=-1) if sp else positions

    def _declare(
        self, d: int, sizes: tuple[int, int, int, int], ranks: int | None, kv_split: bool
    ) -> tuple[list[Pair], jax.Array, jax.Array | None]:
        """The projections' params (this rank's slices where ``ranks`` is set): the q, k and
        v kernels and biases (one fused pair with ``fused_qkv``), the output kernel and bias.
        ``sizes``: the query heads, key/value heads, head width and output width."""
        heads, kv_heads, head_dim, out = sizes
        bias_shape = (heads, head_dim)
        if self.fused_qkv:  # one (d, 3, H, hd) kernel: nanoGPT's c_attn, (d, 3d), reshaped
            pairs = [
                _params.linear(
                    self, "qkv", ranks, (d, 3) + bias_shape, 2, (3,) + bias_shape, 1,
                    split_arg="num_heads",
                )
            ]  # fmt: skip
        else:
            pairs = [
                _params.linear(
                    self, "query", ranks, (d,) + bias_shape, 1, bias_shape, 0, split_arg="num_heads"
                )
            ]
            kv_dim = 1 if kv_split else None  # whole: replicated over the ranks
            kv_arg = "num_heads" if self.num_kv_heads is None else "num_kv_heads"
            pairs += [
                _params.linear(
                    self, name, ranks, (d, kv_heads, head_dim), kv_dim, (kv_heads, head_dim),
                    None if kv_dim is None else 0, split_arg=kv_arg,
                )
                for name in ("key", "value")
            ]  # fmt: skip
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
        pairs: list[Pair],
        axis: str | None,
        ranks: int | None,
        sp: bool,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q ``(..., S, h, hd)`` for this rank's ``h`` query heads, k and v
        ``(..., S, hkv, hd)`` for its key/value heads: column-parallel (no communication),
        each kernel contracted in its own shape (a reshaped kernel would be a new value that
        a rematerialisation policy keeping everything but the gathered params, FSDP's, saves
        for every layer)."""
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
        """Attention of this rank's heads over the sequence it holds whole: no communication.
        Its ``h`` query heads in ``hkv`` groups of consecutive heads, each group over its
        key/value head."""
        head_dim, local_heads, kv_heads = q.shape[-1], q.shape[-2], k.shape[-2]
        grouped = q.shape[:-2] + (kv_heads, local_heads // kv_heads, head_dim)
        q = jnp.reshape(q / jnp.sqrt(head_dim).astype(q.dtype), grouped)
        logits = jnp.einsum("...qkgd,...skd->...kgqs", q, k)  # (..., hkv, g, S, S)
        seq = logits.shape[-1]
        logits = jnp.reshape(logits, logits.shape[:-4] + (local_heads, seq, seq))
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
        probs = jnp.reshape(probs, probs.shape[:-3] + grouped[-3:-1] + (seq, seq))
        o = jnp.einsum("...kgqs,...skd->...qkgd", probs, v)
        return jnp.reshape(o, o.shape[:-3] + (local_heads, head_dim))


def _own_kv_head(pair: Pair, axis: str | None, local_heads: int, group: int) -> Pair:
    """The kernel ``(d, 1, hd)`` and bias ``(1, hd)`` of the one key/value head this rank's
    ``local_heads`` query heads share, from the whole ``(d, Hkv, hd)`` and ``(Hkv, hd)``
    (each ``group`` consecutive query heads share one): ``(r * local_heads) // group``."""
    w, b = pair
    head = lax.axis_index(axis) * local_heads // group
    w = lax.dynamic_slice_in_dim(w, head, 1, axis=1)
    return w, None if b is None else lax.dynamic_slice_in_dim(b, head, 1, axis=0)


def _check_rope(api: str, theta: object, head_dim: int) -> None:
    """``rope_theta`` is None or a positive number, and the heads' width is even."""
    if theta is None:
        return
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real):
        raise TypeError(
            f"{api}: rope_theta must be a number (the RoPE base, e.g. 10000.0) or None, got "
            f"{type(theta).__name__} instead."
        )
    if not float(theta) > 0:
        raise ValueError(f"{api}: rope_theta={theta!r} must be positive (e.g. 10000.0).")
    if head_dim % 2:
        raise ValueError(
            f"{api}: RoPE rotates pairs of a head's dims, so the head width must be even, got "
            f"{head_dim} (qkv_features / num_heads); pick an even head width, or "
            f"rope_theta=None."
        )


def _dropout_heads(weights: jax.Array, rng: jax.Array, heads: jax.Array, rate: float) -> jax.Array:
    """Dropout of ``weights`` (..., h, S, S) whose head i is global head ``heads[i]``: that
    head's mask is drawn from ``fold_in(rng, heads[i])``, the same in the dense layer and on
    the rank that owns the head."""
    per_head = weights.shape[:-3] + weights.shape[-2:]

    def keep_of(head: jax.Array) -> jax.Array:
        return jax.random.bernoulli(jax.random.fold_in(rng, head), 1.0 - rate, per_head)

    keep = jnp.moveaxis(jax.vmap(keep_of)(heads), 0, -3)
    return jnp.where(keep, weights / (1.0 - rate), jnp.zeros_like(weights))
