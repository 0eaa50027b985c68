"""Adapters: pass a flax linen or nnx model (with BatchNorm state, dropout) to the Trainer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import PartitionSpec as P

from .._core.typing import PyTree
from .checks import accepts, loss_output

if TYPE_CHECKING:
    from flax import linen, nnx


def annotated(model: Any, params: PyTree) -> PyTree | None:
    """The model specs a model's own annotations give ``params`` (an :class:`Nnx` model's
    variable metadata: :meth:`Nnx.specs`), where they describe a tree shaped like ``params``;
    else None."""
    specs = model.specs() if isinstance(model, Nnx) else None
    if specs is None:
        return None
    is_p = lambda x: isinstance(x, P)  # noqa: E731
    mine: Any = jax.tree_util.tree_structure(specs, is_leaf=is_p)
    same = mine == jax.tree_util.tree_structure(params)
    has_names = any(s != P() for s in jax.tree_util.tree_leaves(specs, is_leaf=is_p))
    return specs if same and has_names else None


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Build a flax model whose variables carry sharding metadata without a mesh: inside the
    block, nnx variables are created whole on the default device, their metadata
    (``nnx.with_partitioning(init, ("embed", "heads"))``) kept; the Trainer reads it and places
    each param by the layout (flax otherwise places every annotated variable when it is
    created, and without a mesh refuses: "An auto mesh context or metadata is required")::

        with dp.building():
            model = Llama(config, rngs=nnx.Rngs(0))
        trainer = dp.Trainer(dp.Nnx(model, loss), optax.adamw(3e-4), layout=layout)
    """
    from flax import nnx

    with nnx.use_eager_sharding(False):
        yield


# loss(outputs, batch) -> (per-example mean loss, dict of per-example-mean scalar metrics);
# it may also take the keyword arguments ``params`` and ``step`` (see Linen).
OutputLoss = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
# What Model.loss_fn returns: (loss, (metrics, new_model_state)).
ModelOutput = tuple[jax.Array, tuple[dict[str, jax.Array], PyTree]]
LOSS_KEYWORDS = ("params", "step")


def name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def loss_keywords(loss: Callable, params: PyTree, step: jax.Array | None) -> dict[str, Any]:
    """The keyword arguments among ``params`` and ``step`` that ``loss`` accepts."""
    values = {"params": params, "step": step}
    return {k: values[k] for k in LOSS_KEYWORDS if accepts(loss, k)}


class Model:
    """The protocol the Trainer needs from a model with non-trainable state.

    * ``loss_fn(params, model_state, batch, rng) -> (loss, (metrics, new_model_state))``,
      with ``rng=None`` meaning evaluation (no dropout, running statistics); if it takes a
      keyword argument ``step``, it gets the number of steps taken before this one (an int32
      scalar; ``state.step`` in evaluation);
    * ``init(rng, batch) -> (params, model_state)``;
    * optionally ``to_module(params, model_state)``: the trained model in its framework's
      form (:meth:`Trainer.to_module <jaxcoll.dp.Trainer.to_module>`).
    """

    def loss_fn(
        self, params: PyTree, model_state: PyTree, batch: PyTree, rng: jax.Array | None
    ) -> ModelOutput:  # pragma: no cover - protocol
        raise NotImplementedError

    def init(self, rng: jax.Array, batch: PyTree) -> tuple[PyTree, PyTree]:  # pragma: no cover
        raise NotImplementedError

    def to_module(self, params: PyTree, model_state: PyTree) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__}.to_module: this adapter has no "
            f"module form; use the state's params and model_state."
        )


class _OutputLoss(Model):
    """An adapter whose module's outputs go through ``loss(outputs, batch)`` (its ``loss``):
    :class:`Linen`, :class:`Nnx`. A subclass runs the module (:meth:`forward`)."""

    loss: OutputLoss

    def loss_fn(
        self,
        params: PyTree,
        model_state: PyTree,
        batch: PyTree,
        rng: jax.Array | None,
        *,
        step: jax.Array | None = None,
    ) -> ModelOutput:
        outputs, new_state = self.forward(params, model_state, batch, rng)
        out = self.loss(outputs, batch, **loss_keywords(self.loss, params, step))
        who = f"the loss {name_of(self.loss)} given to dp.{type(self).__name__}"
        value, metrics = loss_output(who, out)
        return value, (metrics, new_state)

    def forward(
        self, params: PyTree, model_state: PyTree, batch: PyTree, rng: jax.Array | None
    ) -> tuple[Any, PyTree]:  # pragma: no cover - protocol
        """The module's outputs on ``batch`` and the new model state: in training where
        ``rng`` is a key (dropout from it, BatchNorm statistics updated), else evaluation."""
        raise NotImplementedError


class Linen(_OutputLoss):
    """A ``flax.linen.Module`` called as ``module(batch[input_key], train=bool)`` plus a loss.

    Dropout draws from the ``"dropout"`` rng stream (the Trainer's per-rank, per-step key);
    ``batch_stats`` (BatchNorm) is the model state. For statistics over the global batch use
    :func:`~jaxcoll.dp.SyncBatchNorm` (``nn.BatchNorm`` with the data axis name).

    Args:
        module: the linen module.
        loss: ``loss(outputs, batch) -> (loss, metrics)``, per-example means. If it takes the
            keyword arguments ``params`` (the params tree being differentiated: weight decay
            in the loss, as flax's ImageNet example writes it) or ``step`` (the steps taken
            before this one, e.g. to log a learning-rate schedule), it gets them.
        input_key: the batch entry passed to the module.

    Example::

        >>> def loss(logits, batch, *, params):
        ...     l2 = sum(jnp.sum(w ** 2) for w in jax.tree.leaves(params) if w.ndim > 1)
        ...     return cross_entropy(logits, batch) + 0.5e-4 * l2, {}
        >>> trainer = Trainer(Linen(MyCNN(), loss), optax.sgd(0.1, momentum=0.9))
        >>> params, model_state = trainer.model.init(jax.random.key(0), first_batch)
        >>> state = trainer.init(params, jax.random.key(1), model_state=model_state)
    """

    def __init__(self, module: linen.Module, loss: OutputLoss, *, input_key: str = "x") -> None:
        if not callable(loss):
            raise TypeError(
                f"dp.Linen: loss must be a callable loss(outputs, batch), got "
                f"{type(loss).__name__} instead."
            )
        self.module = module
        self.loss = loss
        self.input_key = input_key

    def init(self, rng: jax.Array, batch: PyTree) -> tuple[PyTree, PyTree]:
        variables = self.module.init(
            {"params": rng, "dropout": rng}, batch[self.input_key], train=False
        )
        variables = dict(variables)
        params = variables.pop("params")
        return params, variables

    def forward(
        self, params: PyTree, model_state: PyTree, batch: PyTree, rng: jax.Array | None
    ) -> tuple[Any, PyTree]:
        train = rng is not None
        variables = {"params": params, **model_state}
        kwargs: dict[str, Any] = {"rngs": {"dropout": rng}} if train else {}
        if train and model_state:
            outputs, new_state = self.module.apply(
                variables, batch[self.input_key], train=True, mutable=list(model_state), **kwargs
            )
            new_state = dict(new_state)
        else:
            outputs = self.module.apply(variables, batch[self.input_key], train=train, **kwargs)
            new_state = model_state
        return outputs, new_state

    def to_module(self, params: PyTree, model_state: PyTree) -> linen.Module:
        """The module bound to the trained variables: call it as ``bound(x, train=False)``."""
        return self.module.bind({"params": params, **model_state})


NnxCall = Callable[..., Any]

#: The linen collections flax's bridge maps to nnx types of its own, none of them model state.
_NOT_STATE = ("params", "batch_stats", "cache", "intermediates", "perturbations")


def _model_state(path: tuple, value: Any) -> bool:
    """An ``nnx`` filter: a ``BatchStat``, or a variable a bridged linen layer keeps in a
    collection of its own (``ToNNX`` gives each such collection its own variable type), as
    :class:`Linen` keeps every collection ``init`` returned besides the params."""
    from flax import nnx
    from flax.nnx import variablelib

    if isinstance(value, nnx.BatchStat):
        return True
    bridged = {t for name, t in variablelib.VariableTypeCache.items() if name not in _NOT_STATE}
    return isinstance(value, nnx.Variable) and type(value) in bridged


class Nnx(_OutputLoss):
    """A ``flax.nnx.Module`` called as ``module(batch[input_key])`` (or by ``call``) plus a loss.

    The module is split once into its graph, its ``nnx.Param`` state (the params), its
    ``nnx.BatchStat`` state and the collections of bridged linen layers that are neither
    params nor intermediates (e.g. :class:`jaxcoll.nn.MoE`'s routing bias): the model state,
    and the rest (``nnx.Rngs`` streams, constants).
    Each call rebuilds a module from them inside the traced step, so modules holding
    ``nnx.Rngs`` (``nnx.Dropout(rate, rngs=rngs)``) work: training calls ``module.train()``
    and reseeds every rng stream of the module from the Trainer's per-rank, per-step key
    (masks differ per rank and are reproducible); evaluation calls ``module.eval()``. The
    module passed in is never modified; :meth:`to_module` returns a trained copy.

    Args:
        module: the nnx module, built already.
        loss: ``loss(outputs, batch) -> (loss, metrics)``, per-example means; may take the
            keyword arguments ``params`` and ``step`` (see :class:`Linen`).
        input_key: the batch entry passed to the module when ``call`` is None.
        call: ``call(model, batch, *, train, rngs) -> outputs``, for modules called with more
            than one argument: ``train`` is a Python bool, ``rngs`` an ``nnx.Rngs`` seeded
            from the per-rank step key in training, None in evaluation. E.g. flax's MNIST
            CNN: ``call=lambda m, b, *, train, rngs: m(b["image"], rngs=rngs)``; a module
            taking a flag: ``lambda m, b, *, train, rngs: m(b["x"], train=train)``.

    Example::

        >>> adapter = Nnx(MyNnxCNN(rngs=nnx.Rngs(0)), cross_entropy)
        >>> params, model_state = adapter.init()
        >>> ... train ...
        >>> model = trainer.to_module(state)        # an nnx module with the trained weights
    """

    def __init__(
        self,
        module: nnx.Module,
        loss: OutputLoss,
        *,
        input_key: str = "x",
        call: NnxCall | None = None,
    ) -> None:
        from flax import nnx

        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"dp.Nnx: module must be a flax.nnx.Module, got "
                f"{type(module).__name__} instead (a linen module goes to "
                f"dp.Linen)."
            )
        if not callable(loss):
            raise TypeError(
                f"dp.Nnx: loss must be a callable loss(outputs, batch), got "
                f"{type(loss).__name__} instead."
            )
        if call is not None and not callable(call):
            raise TypeError(
                f"dp.Nnx: call must be a callable call(model, batch, *, train, "
                f"rngs), got {type(call).__name__} instead."
            )
        self.loss = loss
        self.input_key = input_key
        self.call = call
        # Three filters: the graph and exactly three states (flax types the tail as variadic).
        self._graph, self._params, *states = nnx.split(module, nnx.Param, _model_state, ...)
        self._stats, self._rest = states

    def init(self, rng: jax.Array | None = None, batch: PyTree = None) -> tuple[PyTree, PyTree]:
        """The module's current params and BatchNorm statistics (it is built already)."""
        from flax import nnx

        return nnx.to_pure_dict(self._params), nnx.to_pure_dict(self._stats)

    def merge(self, params: PyTree, model_state: PyTree) -> nnx.Module:
        """A new module: the graph with ``params`` and ``model_state`` (pure dicts)."""
        from flax import nnx

        # New Variable objects, created at the caller's trace level: nnx refuses to update a
        # Variable (BatchNorm statistics, rng counters) made outside the current trace.
        fresh = lambda s: jax.tree_util.tree_map(lambda v: v, s)  # noqa: E731
        p, s, rest = fresh(self._params), fresh(self._stats), fresh(self._rest)
        nnx.replace_by_pure_dict(p, params)
        nnx.replace_by_pure_dict(s, model_state)
        return nnx.merge(self._graph, p, s, rest)

    def forward(
        self, params: PyTree, model_state: PyTree, batch: PyTree, rng: jax.Array | None
    ) -> tuple[Any, PyTree]:
        from flax import nnx

        model = self.merge(params, model_state)
        train = rng is not None
        rngs = None
        if rng is not None:  # training
            model.train()
            key = (
                rng
                if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
                else jax.random.wrap_key_data(rng)
            )
            tags = sorted(
                {
                    stream.key.tag
                    for _, stream in nnx.iter_graph(model)
                    if isinstance(stream, nnx.RngStream)
                }
            )
            if tags:  # every stream of the module draws from this rank's step key
                # Typed Any: a dict[str, Array] could, as far as mypy knows, hold reseed's own
                # keywords (graph, policy), which take other types.
                keys: dict[str, Any] = {
                    t: jax.random.fold_in(key, i + 1) for i, t in enumerate(tags)
                }
                nnx.reseed(model, policy="match_shape", **keys)
            rngs = nnx.Rngs(jax.random.fold_in(key, 0))
        else:
            model.eval()
        if self.call is None:
            outputs = model(batch[self.input_key])
        else:
            outputs = self.call(model, batch, train=train, rngs=rngs)
        new_stats = nnx.to_pure_dict(nnx.state(model, _model_state)) if train else model_state
        return outputs, new_stats

    def specs(self) -> PyTree:
        """Each param's sharding metadata as a ``PartitionSpec`` of its names (logical axes,
        roles or mesh axes: ``nnx.with_partitioning(init, ("embed", "heads"))``,
        ``nnx.Param(v, out_sharding=...)``), shaped like :meth:`init`'s params; a param
        without metadata whole. The Trainer reads them as the model specs."""
        from flax import nnx

        def spec(v: Any) -> Any:
            names = v.get_metadata().get("out_sharding")
            return v.replace(P(*names) if names else P())

        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        return nnx.to_pure_dict(jax.tree_util.tree_map(spec, self._params, is_leaf=is_var))

    def to_module(self, params: PyTree, model_state: PyTree) -> nnx.Module:
        """A new nnx module with ``params`` and the BatchNorm statistics ``model_state``
        (the module passed in keeps its own). ``nnx.update(module, nnx.state(trained))``
        writes them into the original instead."""
        return self.merge(params, model_state)
