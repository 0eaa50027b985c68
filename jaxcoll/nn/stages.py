"""An nnx model's blocks as pipeline stages, the model file unchanged: :func:`stack_blocks`.

Users' nnx models keep their blocks in a Python list (``self.layers = nnx.List([Block(...)
for _ in range(L)])``) and call them in a for loop. A pipeline wants the blocks' params
stacked on a leading axis of L that a layout splits over its stages, and a ``stage_fn`` that
runs a stage's consecutive blocks. :func:`stack_blocks` gives both from the list, plus the
way back (:meth:`BlockStack.update`, the trained params into the blocks), and
:meth:`BlockStack.rest` the model's other params (the embedding, the head) with a module to
call them by::

    stack = jnn.stack_blocks(model.layers)                # (L, ...) params, "layers" first
    rest = stack.rest(model)                              # the embedding, the head, ...
    params = {"blocks": stack.params, "rest": rest.params}
    specs = {"blocks": stack.specs, "rest": rest.specs}   # from the params' out_sharding

    def head(rest_params, h, y):
        return cross_entropy(rest.module(rest_params).head(h), y)

    def loss_fn(params, batch, rng):
        h = rest.module(params["rest"]).embed(batch["tokens"])
        side = {"positions": batch["positions"], "segment_ids": batch["segment_ids"]}
        loss = parallel.pipeline_loss(
            stack.stage_fn, head, params["blocks"], params["rest"], h, batch["y"], side=side
        )
        return loss, {}

    state = trainer.init(params, key, specs=specs)
    ...
    stack.update(trained["blocks"]); rest.update(trained["rest"])  # into the model

Each stage calls its blocks through the block's graph (``nnx.merge`` of one block's graph
and one layer of the stacked params, inside a ``lax.scan`` over the layers it holds), as
``block(h, **side)`` (side inputs as keyword arguments) or by ``call``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from .._core.typing import PyTree

#: The logical axis of the stacked blocks: a layout's pipeline axis (``LOGICAL_AXES``).
LAYERS = "layers"

BlockCall = Callable[[nnx.Module, jax.Array, Any], jax.Array]
"""``call(block, h, side) -> h``: how a stage calls one block (``side``: None without)."""


def _default_call(block: nnx.Module, h: jax.Array, side: Any) -> jax.Array:
    """``block(h)``; with side inputs ``block(h, **side)`` (a mapping) or ``block(h, side)``."""
    if side is None:
        return block(h)
    if isinstance(side, Mapping):
        return block(h, **side)
    return block(h, side)


def _spec(variable: nnx.Variable, *lead: str | None) -> P:
    """The variable's ``out_sharding`` metadata as a ``PartitionSpec``, after ``lead``."""
    names = variable.get_metadata().get("out_sharding")
    return P(*lead, *(tuple(names) if names else ()))


def _pure(state: nnx.State) -> dict:
    return nnx.to_pure_dict(state)


def _fresh(state: nnx.State, values: PyTree) -> nnx.State:
    """A copy of ``state`` (new Variables, made at the caller's trace level) holding
    ``values``, a pure dict shaped like it."""
    copy = jax.tree_util.tree_map(lambda v: v, state)
    nnx.replace_by_pure_dict(copy, values)
    return copy


def _non_params(api: str, where: str, state: nnx.State) -> None:
    """Raise where ``state`` (what is not an ``nnx.Param``) holds anything."""
    flat = nnx.to_flat_state(state)
    if len(flat):
        found = ", ".join(
            f"{'/'.join(map(str, path))} ({type(v).__name__})" for path, v in list(flat)[:4]
        )
        raise ValueError(
            f"{api}: {where} holds state that is no nnx.Param: {found}. A pipeline stage "
            f"carries its blocks' params only (no BatchNorm statistics, rng streams or "
            f"other variables, which would not follow the layers over the stages); hold them "
            f"outside the blocks, or make them nnx.Param."
        )


class BlockStack:
    """A list of nnx blocks of one structure, as pipeline stages: their params stacked on a
    leading axis (the logical axis ``"layers"``), a ``stage_fn`` that runs any consecutive
    run of them, and the way back into the blocks. Build it by :func:`stack_blocks`.

    Attributes:
        graphdef: one block's graph (every block has the same).
        params: the blocks' ``nnx.Param`` values as a pure dict (``nnx.to_pure_dict``), each
            leaf stacked ``(L, ...)`` in the list's order.
        specs: each leaf's model spec: ``P("layers", *names)``, ``names`` the param's
            ``out_sharding`` metadata (``nnx.with_partitioning(init, ("embed", "mlp"))``);
            pass it as the Trainer's ``specs=`` (a layout with a pipeline role splits the
            layers over its stages, one without runs them whole).
        blocks: the blocks it was built from (what :meth:`update` writes into).
    """

    def __init__(self, blocks: Sequence[nnx.Module], call: BlockCall | None = None) -> None:
        api = "stack_blocks"
        self.blocks = list(blocks)
        # Two filters: the graph and exactly two states (flax types the tail as variadic).
        graphdef, state, *rest = nnx.split(self.blocks[0], nnx.Param, ...)
        (other,) = rest
        self.graphdef = graphdef
        _non_params(api, "blocks[0]", other)
        for i, block in enumerate(self.blocks[1:], 1):
            if nnx.graphdef(block) != self.graphdef:
                raise ValueError(
                    f"{api}: blocks[{i}] ({type(block).__name__}) differs in structure from "
                    f"blocks[0] ({type(self.blocks[0]).__name__}): other submodules, shapes "
                    f"or settings; stacked blocks are one block's graph run L times. Stack "
                    f"each run of identical blocks on its own."
                )
        self._state, self._other = state, other
        self._call = _default_call if call is None else call
        per_block = [_pure(nnx.state(b, nnx.Param)) for b in self.blocks]
        self.params = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *per_block)
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        self.specs = _pure(
            jax.tree_util.tree_map(lambda v: v.replace(_spec(v, LAYERS)), state, is_leaf=is_var)
        )

    def block(self, layer: PyTree) -> nnx.Module:
        """A block holding ``layer``, one layer of the stacked params (a pure dict)."""
        return nnx.merge(self.graphdef, _fresh(self._state, layer), self._other)

    def stage_fn(self, params: PyTree, h: jax.Array, side: Any = None) -> jax.Array:
        """Run the blocks whose params ``params`` stacks (a stage's consecutive blocks, or
        all of them), in order, on ``h``: a ``lax.scan`` over the leading axis, each block
        called as ``block(h, **side)`` (or by ``call``). The ``stage_fn`` of
        :func:`jaxcoll.parallel.pipeline_loss` (``side`` its side inputs)."""

        def one(h: jax.Array, layer: PyTree) -> tuple[jax.Array, None]:
            return self._call(self.block(layer), h, side), None

        return jax.lax.scan(one, h, params)[0]

    def unstack(self, params: PyTree) -> list[dict]:
        """The stacked ``params`` as one pure dict per block, in order."""
        n = len(self.blocks)
        return [jax.tree_util.tree_map(lambda t, i=i: t[i], params) for i in range(n)]

    def update(self, params: PyTree) -> None:
        """Write the stacked ``params`` (e.g. trained: ``trainer.host_params(state)``'s part)
        into the blocks, in place (``nnx.update``); outside any trace."""
        for block, layer in zip(self.blocks, self.unstack(params), strict=True):
            nnx.update(block, _fresh(nnx.state(block, nnx.Param), layer))

    def rest(self, model: nnx.Module) -> ModelRest:
        """The params of ``model`` outside these blocks (its embedding, head, norms), their
        specs, and a module to call those parts by: :class:`ModelRest`."""
        return ModelRest(model, self.blocks)


class ModelRest:
    """The params of an nnx model outside its stacked blocks, and the model to call its other
    parts (the embedding, the head) with them: :meth:`BlockStack.rest`.

    Attributes:
        params: those ``nnx.Param`` values, a pure dict shaped as the model's.
        specs: each one's ``out_sharding`` metadata as a ``PartitionSpec`` (``P()`` without).
        model: the model (what :meth:`update` writes into).
    """

    def __init__(self, model: nnx.Module, blocks: Sequence[nnx.Module]) -> None:
        ids = {
            id(v)
            for block in blocks
            for _, v in nnx.iter_graph(block)
            if isinstance(v, nnx.Variable)
        }
        in_blocks = lambda path, v: id(v) in ids  # noqa: E731
        self.model = model
        graph, stacked, *states = nnx.split(model, in_blocks, nnx.Param, ...)
        self._graph = graph
        self._state, self._other = states
        if not len(nnx.to_flat_state(stacked)):
            raise ValueError(
                f"ModelRest: none of the {len(blocks)} blocks is part of the "
                f"{type(model).__name__} given; pass the model that holds them "
                f"(stack_blocks(model.layers).rest(model))."
            )
        # The blocks as shapes only: the module can call everything but them.
        self._blocks = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), stacked
        )
        self.params = _pure(self._state)
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        self.specs = _pure(
            jax.tree_util.tree_map(lambda v: v.replace(_spec(v)), self._state, is_leaf=is_var)
        )

    def module(self, params: PyTree) -> nnx.Module:
        """The model holding ``params`` (a pure dict shaped as :attr:`params`), traced or
        not: call its parts but the blocks (which hold only their shapes here), e.g.
        ``rest.module(p).embed(tokens)``."""
        return nnx.merge(self._graph, self._blocks, _fresh(self._state, params), self._other)

    def update(self, params: PyTree) -> None:
        """Write ``params`` into the model, in place (``nnx.update``); outside any trace."""
        nnx.update(self.model, _fresh(self._state, params))


def stack_blocks(blocks: Sequence[nnx.Module], *, call: BlockCall | None = None) -> BlockStack:
    """An nnx model's list of blocks as pipeline stages, the model unchanged.

    Stacks the blocks' ``nnx.Param`` values on a leading axis of ``len(blocks)`` (the logical
    axis ``"layers"``, which a layout with a pipeline role splits over its stages) and gives
    a ``stage_fn`` for :func:`jaxcoll.parallel.pipeline_loss` that runs a stage's
    consecutive blocks through one block's graph. Equivalent to the model's own loop::

        for block in blocks:                         # stack.stage_fn(stack.params, h, side)
            h = block(h, **side)

    Args:
        blocks: the blocks, in the order the model calls them (``model.layers``: an
            ``nnx.List`` or any sequence), all of one structure (``nnx.graphdef`` equal),
            holding ``nnx.Param`` variables only.
        call: ``call(block, h, side) -> h``, how a stage calls one block; default
            ``block(h)``, or with side inputs ``block(h, **side)`` (a dict of them) or
            ``block(h, side)``.

    Returns:
        A :class:`BlockStack`: ``params``, ``specs``, ``stage_fn``, ``update`` (the params
        back into the blocks), ``rest(model)`` (the model's other params).

    Raises:
        ValueError: no blocks, blocks of different structures, or a block holding state that
            is no ``nnx.Param`` (BatchNorm statistics, rng streams).
        TypeError: a block that is no ``nnx.Module``, or ``call`` not callable.

    Example (a model created without a mesh: ``with nnx.use_eager_sharding(False):``)::

        >>> stack = stack_blocks(model.layers)
        >>> stack.params["attn"]["qkv"]["kernel"].shape      # (L, d, 3d)
        >>> stack.specs["attn"]["qkv"]["kernel"]             # P("layers", "embed", "heads")
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("stack_blocks: blocks is empty; pass the model's list of blocks.")
    for i, block in enumerate(blocks):
        if not isinstance(block, nnx.Module):
            raise TypeError(
                f"stack_blocks: blocks[{i}] must be a flax.nnx.Module, got "
                f"{type(block).__name__} instead (a linen model's blocks are stacked by "
                f"jax.tree.map(jnp.stack) of their params)."
            )
    if call is not None and not callable(call):
        raise TypeError(
            f"stack_blocks: call must be a callable call(block, h, side) -> h, got "
            f"{type(call).__name__} instead."
        )
    return BlockStack(blocks, call)
