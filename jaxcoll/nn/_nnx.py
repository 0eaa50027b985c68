"""jaxcoll.nn's layers inside flax nnx models: the recipe, and :func:`pop_moe_metrics`.

The layers are linen modules; flax's own bridge, ``nnx.bridge.ToNNX``, makes each an nnx
module, its params ``nnx.Param`` variables. The bridge keeps each param's split: a layer's
``nn.with_partitioning`` box becomes the variable's ``out_sharding`` metadata
(``(None, "tensor", None)`` for a query kernel, ``("expert", None, None)`` for an MoE's
experts), which :class:`jaxcoll.dp.Nnx` reads as the model specs. So the recipe is::

    class Block(nnx.Module):
        def __init__(self, d, *, rngs):
            x = jnp.zeros((1, 16, d))                      # a sample input: fixes the shapes
            self.attn = nnx.bridge.ToNNX(
                jcnn.ParallelSelfAttention(num_heads=8, num_kv_heads=2, rope_theta=1e4,
                                           use_bias=False), rngs=rngs).lazy_init(x)
            self.moe = nnx.bridge.ToNNX(jcnn.MoE(8, 4 * d), rngs=rngs).lazy_init(x)

        def __call__(self, h, positions):
            h = h + self.attn(h, positions)                # the linen layer's arguments
            return h + self.moe(h, mutable=["intermediates"])   # keep what the MoE sows

    with dp.building():                                    # variables with metadata, no mesh
        model = Model(..., rngs=nnx.Rngs(0))
    trainer = dp.Trainer(dp.Nnx(model, loss, call=call), optax.adamw(3e-4), layout=layout)

(``jcnn`` is ``jaxcoll.nn``). Built under ``dp.building()`` the variables are made whole on
the default device with their metadata kept (flax otherwise places a variable with sharding
metadata as it is created, and without a mesh refuses). Inside the Trainer's step the layers
find the layout's roles as they do in linen: the tensor-parallel collectives, the context
attention, the experts' all-to-alls. For ``ParallelSelfAttention`` with more tensor ranks
``n`` than key/value heads, build the model where the layer sees the tensor degree, so that it
declares K and V whole (replicated over the ranks)::

    abstract = jax.sharding.AbstractMesh((n,), ("tensor",))  # shapes only: places nothing
    with dp.building(), jax.sharding.use_abstract_mesh(abstract):
        model = Model(..., rngs=nnx.Rngs(0))

A linen layer's ``sow`` reaches nnx only where the bridged layer is called with
``mutable=["intermediates"]``: the :class:`~jaxcoll.parallel.Load` an :class:`MoE` sows is
then an ``nnx.Intermediate`` of the bridged module, as ``self.sow(nnx.Intermediate, ...)``
leaves it in nnx. :func:`pop_moe_metrics` takes every such load out of the model and gives
:func:`jaxcoll.parallel.moe_metrics` of them, so the loss can add the auxiliary loss::

    def call(model, batch, *, train, rngs):                # dp.Nnx(model, loss, call=call)
        logits = model(batch["tokens"], batch["positions"])
        return logits, jcnn.pop_moe_metrics(model)

    def loss(outputs, batch):
        logits, moe = outputs
        return cross_entropy(logits, batch) + 0.01 * moe["moe_aux"], moe

Example (one device)::

    >>> class Block(nnx.Module):
    ...     def __init__(self, rngs):
    ...         attention = ParallelSelfAttention(num_heads=4, num_kv_heads=2, rope_theta=1e4)
    ...         x = jnp.zeros((1, 8, 16))
    ...         self.attn = nnx.bridge.ToNNX(attention, rngs=rngs).lazy_init(x)
    ...     def __call__(self, h, positions):
    ...         return h + self.attn(h, positions)
    >>> with dp.building():  # shapes and metadata only: nnx.eval_shape computes nothing
    ...     block = nnx.eval_shape(lambda: Block(nnx.Rngs(0)))
    >>> params = nnx.state(block, nnx.Param)
    >>> params["attn"]["key"]["kernel"].get_metadata()["out_sharding"]
    (None, 'tensor', None)
    >>> dp.Nnx(block, loss=lambda y, b: (y.mean(), {})).specs()["attn"]["out"]["kernel"]
    P('tensor', None, None)
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ..parallel import Load, moe_metrics
from .moe import MoE


def _has_load(value: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda v: isinstance(v, Load))
    return any(isinstance(v, Load) for v in leaves)


def _holds_load(path: tuple, value: Any) -> bool:
    """An nnx filter: an ``nnx.Intermediate`` that holds a :class:`Load`."""
    return isinstance(value, nnx.Intermediate) and _has_load(value.get_value())


def pop_moe_metrics(module: nnx.Module) -> dict[str, jax.Array]:
    """Take the loads the model's mixtures of experts sowed out of ``module`` and return their
    metrics: :func:`jaxcoll.parallel.moe_metrics` of them (``moe_aux``, the load-balancing
    losses summed over the layers, to add to the loss; ``moe_dropped``; ``moe_imbalance``).

    Equivalent to ``parallel.moe_metrics(nnx.pop(module, filter))``, ``filter`` keeping the
    ``nnx.Intermediate`` variables that hold a :class:`~jaxcoll.parallel.Load`: the ones a
    bridged :class:`MoE` called with ``mutable=["intermediates"]`` sows
    (``nnx.bridge.ToNNX``), or an nnx module's own ``self.sow(nnx.Intermediate, name, load)``
    of :func:`jaxcoll.parallel.moe_mlp`'s load. Other intermediates stay. Popped, they are not
    counted again by the next call (a bridged layer adds its sown values to those it holds).

    Args:
        module: the nnx model, after its forward pass.

    Returns:
        The metrics, each over the whole batch (the loads are summed over the data axes);
        ``{}`` where the model holds no MoE and no load.

    Raises:
        ValueError: the model holds a bridged :class:`MoE` but no load: it was called
            without ``mutable=["intermediates"]`` (its load, and so its auxiliary loss, was
            dropped), or not called since the last pop.
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"nn.pop_moe_metrics: module must be a flax.nnx.Module (the model after its "
            f"forward pass), got {type(module).__name__} instead; for a linen model's sown "
            f"intermediates use jaxcoll.parallel.moe_metrics."
        )
    popped = nnx.pop(module, _holds_load)
    if not _has_load(popped):
        bridged = [
            "/".join(str(p) for p in path) or "(the model)"
            for path, node in nnx.iter_graph(module)
            if isinstance(getattr(node, "to_nnx__module", None), MoE)
        ]
        if bridged:
            raise ValueError(
                f"nn.pop_moe_metrics: the model holds the bridged MoE {bridged[0]!r} but no "
                f"load it sowed: call it as moe(x, mutable=['intermediates']) (nnx.bridge."
                f"ToNNX drops what a linen layer sows otherwise, and with it the auxiliary "
                f"loss), and pop once per forward pass."
            )
    return moe_metrics(popped)
