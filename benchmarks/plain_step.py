"""The plain-JAX training step the benchmarks' GSPMD rows compile: ``jax.jit`` of the loss's
gradient and the optax update, the params and optimizer state placed by ``NamedSharding``
and donated, XLA's partitioner doing the rest (what a user writes without jaxcoll)."""

from __future__ import annotations

import jax
import optax


def jit_step(loss_fn, opt, params_sharding, opt_sharding, batch_sharding, replicated):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted with those
    shardings (``loss_fn(params, batch) -> (loss, aux)``)."""

    def step(params, opt_state, batch):
        loss, g = jax.value_and_grad(lambda p: loss_fn(p, batch)[0])(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(
        step,
        in_shardings=(params_sharding, opt_sharding, batch_sharding),
        out_shardings=(params_sharding, opt_sharding, replicated),
        donate_argnums=(0, 1),
    )
