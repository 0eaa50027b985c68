"""The model tests/dp/test_layout.py trains in every layout.

Written once, naming no mesh axis (roles and logical axes, which the Trainer's layout maps to
its mesh axes): an input projection, a stack of residual Megatron MLP blocks (the hidden units
split over the tensor axis, one all-reduce per block; the stacked layers split over the
pipeline axis and run by ``parallel.pipeline_loss``) and an output projection. Run over a
layout's axes it sees this device's slices; on one device (the axes unbound) it is the dense
model. Twin copies: Adam and plain SGD (which catches a gradient off by a factor).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxcoll import parallel

D, F, L, C = 16, 32, 4, 4  # width, hidden units, layers, classes
BATCH, STEPS, MICRO = 16, 20, 2
TOL = 1e-5
TWIN = ("adam", "sgd")


# --------------------------------------------------------------------------------- model
def init_copy(key):
    k = jax.random.split(key, 5)
    return {
        "inp": jax.random.normal(k[0], (D, D)) * 0.3,
        "blocks": {
            "w1": jax.random.normal(k[1], (L, D, F)) * (0.5 / np.sqrt(D)),
            "b1": jax.random.normal(k[2], (L, F)) * 0.1,
            "w2": jax.random.normal(k[3], (L, F, D)) * (0.5 / np.sqrt(F)),
            "b2": jnp.zeros((L, D)),
            "scale": jnp.ones((L, D)),
        },
        "out": jax.random.normal(k[4], (D, C)) * 0.3,
    }


#: Each leaf's logical axes: "layers" (stacked blocks) over the layout's pipeline axis,
#: "mlp" (hidden units) over its tensor axis; whole where the layout has no such axis.
COPY_SPECS = {
    "inp": P(),
    "blocks": {
        "w1": P("layers", None, "mlp"),
        "b1": P("layers", "mlp"),
        "w2": P("layers", "mlp", None),
        "b2": P("layers"),
        "scale": P("layers"),
    },
    "out": P(),
}
SPECS = {k: COPY_SPECS for k in TWIN}


def block(h, layer):
    x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5) * layer["scale"]
    mlp = {k: layer[k] for k in ("w1", "b1", "w2", "b2")}
    if parallel.is_bound("tensor"):
        y = parallel.mlp(mlp, x, "tensor")  # one all-reduce over the tensor axis
    else:
        y = parallel.gelu(x @ mlp["w1"] + mlp["b1"]) @ mlp["w2"] + mlp["b2"]
    return h + y, None


def stage(blocks, h):
    return jax.lax.scan(block, h, blocks)[0]  # this stage's layers (all of them, dense)


def head_loss(head, h, y):
    """The output projection and the loss of one micro-batch (the pipeline's last stage)."""
    logp = jax.nn.log_softmax(h @ head["out"])
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


def interleave(tree, v):
    """The stacked blocks ``(L, ...)`` as ``parallel.Interleaved(M, virtual=v)`` takes them,
    ``(v, L // v, ...)`` (its specs: ``None`` before the pipeline axis); ``v=-1``: back."""
    return jax.tree_util.tree_map(
        lambda t: t.reshape((-1,) + t.shape[2:]) if v == -1 else t.reshape((v, -1) + t.shape[1:]),
        tree,
    )


def scheduled_loss(schedule=None):
    """``loss_fn`` with the blocks run by ``schedule`` (default: the Trainer's layout's) by
    ``parallel.pipeline_loss``: its own backward inside the Trainer's ``jax.value_and_grad``;
    dense where the layout has no pipeline axis."""

    def loss(params, batch, rng):
        losses = {}
        for k in TWIN:
            p = params[k]
            h = jnp.tanh(batch["x"] @ p["inp"])
            losses[k] = parallel.pipeline_loss(
                stage,
                head_loss,
                p["blocks"],
                {"out": p["out"]},
                h,
                batch["y"],
                schedule=schedule,
            )
        return losses["adam"] + losses["sgd"], {f"loss_{k}": v for k, v in losses.items()}

    return loss


#: The loss every layout trains: the blocks by GPipe over MICRO micro-batches (whatever the
#: layout's schedule), dense where the layout has no pipeline axis.
loss_fn = scheduled_loss(parallel.GPipe(MICRO))


def optimizer():
    labels = lambda p: {k: jax.tree_util.tree_map(lambda _, k=k: k, v) for k, v in p.items()}  # noqa: E731
    return optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1)}, labels)


def data():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        x = rng.normal(size=(BATCH, D)).astype(np.float32)
        out.append({"x": x, "y": x[:, :C].argmax(-1).astype(np.int32)})
    return out


def params0():
    keys = jax.random.split(jax.random.key(0), 2)
    return {k: init_copy(key) for k, key in zip(TWIN, keys, strict=True)}


def reference():
    """Plain single-device optax on the whole batches (the model dense): the final params."""
    opt = optimizer()
    params = params0()
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(lambda p: loss_fn(p, batch, None)[0])(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for batch in data():
        params, state = step(params, state, batch)
    return jax.device_get(params)
