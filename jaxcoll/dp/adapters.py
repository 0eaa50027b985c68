"""Adapters: pass a flax linen or nnx model (with BatchNorm state, dropout) to the Trainer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core.typing import PyTree

# loss(outputs, batch) -> (per-example mean loss, dict of per-example-mean scalar metrics)
OutputLoss = Callable[[Any, PyTree], tuple[jax.Array, dict[str, jax.Array]]]


class Model:
    """The protocol the Trainer needs from a model with non-trainable state.

    ``loss_fn(params, model_state, batch, rng) -> (loss, (aux, new_model_state))``, with
    ``rng=None`` meaning evaluation (no dropout, running statistics), and
    ``init(rng, batch) -> (params, model_state)``.
    """

    def loss_fn(self, params, model_state, batch, rng):  # pragma: no cover - protocol
        raise NotImplementedError

    def init(self, rng: jax.Array, batch: PyTree) -> tuple[PyTree, PyTree]:  # pragma: no cover
        raise NotImplementedError


class Linen(Model):
    """A ``flax.linen.Module`` called as ``module(batch[input_key], train=bool)`` plus a loss.

    Dropout draws from the ``"dropout"`` rng stream (the Trainer's per-rank, per-step key);
    ``batch_stats`` (BatchNorm) is the model state. For statistics over the global batch use
    :func:`~jaxcoll.dp.SyncBatchNorm` (``nn.BatchNorm`` with the data axis name).

    Args:
        module: the linen module.
        loss: ``loss(outputs, batch) -> (loss, aux)``, per-example means.
        input_key: the batch entry passed to the module.

    Example::

        >>> trainer = Trainer(Linen(MyCNN(), cross_entropy), optax.adam(1e-3))
        >>> params, model_state = trainer.model.init(jax.random.key(0), first_batch)
        >>> state = trainer.init(params, jax.random.key(1), model_state=model_state)
    """

    def __init__(self, module: Any, loss: OutputLoss, *, input_key: str = "x") -> None:
        self.module = module
        self.loss = loss
        self.input_key = input_key

    def init(self, rng: jax.Array, batch: PyTree) -> tuple[PyTree, PyTree]:
        variables = self.module.init({"params": rng, "dropout": rng}, batch[self.input_key],
                                     train=False)
        variables = dict(variables)
        params = variables.pop("params")
        return params, variables

    def loss_fn(self, params, model_state, batch, rng):
        train = rng is not None
        variables = {"params": params, **model_state}
        kwargs: dict[str, Any] = {"rngs": {"dropout": rng}} if train else {}
        if train and model_state:
            outputs, new_state = self.module.apply(variables, batch[self.input_key], train=True,
                                                   mutable=list(model_state), **kwargs)
            new_state = dict(new_state)
        else:
            outputs = self.module.apply(variables, batch[self.input_key], train=train, **kwargs)
            new_state = model_state
        value, aux = self.loss(outputs, batch)
        return value, (dict(aux or {}), new_state)


class Nnx(Model):
    """A ``flax.nnx.Module`` called as ``module(batch[input_key])`` plus a loss.

    The module is split once into its graph, its ``nnx.Param`` state (the params) and the
    rest (``nnx.BatchStat``: the model state). Training calls ``module.train()``, evaluation
    ``module.eval()``. Dropout streams are reseeded each step from the Trainer's per-rank key
    (``nnx.reseed``), so masks differ per rank and are reproducible.

    Example::

        >>> adapter = Nnx(MyNnxMLP(rngs=nnx.Rngs(0)), cross_entropy)
        >>> params, model_state = adapter.init(None, None)
    """

    def __init__(self, module: Any, loss: OutputLoss, *, input_key: str = "x") -> None:
        from flax import nnx

        self.loss = loss
        self.input_key = input_key
        self._graph, self._params, self._stats, self._rest = nnx.split(
            module, nnx.Param, nnx.BatchStat, ...)

    def init(self, rng: jax.Array | None = None, batch: PyTree = None) -> tuple[PyTree, PyTree]:
        """The module's current params and BatchNorm statistics (it is built already)."""
        from flax import nnx

        return nnx.to_pure_dict(self._params), nnx.to_pure_dict(self._stats)

    def loss_fn(self, params, model_state, batch, rng):
        from flax import nnx

        p, s = nnx.State(self._params), nnx.State(self._stats)
        nnx.replace_by_pure_dict(p, params)
        nnx.replace_by_pure_dict(s, model_state)
        model = nnx.merge(self._graph, p, s, self._rest)
        if rng is None:
            model.eval()
        else:
            model.train()
            nnx.reseed(model, dropout=rng)
        outputs = model(batch[self.input_key])
        value, aux = self.loss(outputs, batch)
        new_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)) if rng is not None \
            else model_state
        return value, (dict(aux or {}), new_stats)
