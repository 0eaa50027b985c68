"""Mixture of experts: route each token to its expert's rank, run the expert MLP, combine back.

    python examples/05_moe_dispatch.py        # 4 simulated CPU devices, a few seconds

4 ranks hold 2 experts each (8 experts). Every rank has 16 tokens; a router picks one expert
per token (top-1, gated by its softmax probability), so each rank sends a DIFFERENT number of
tokens to each other rank: torch's ``all_to_all_single(out, x, output_split_sizes,
input_split_sizes)``. Inside ``jax.shard_map`` that is ``jaxcoll.parallel.dispatch`` (a
``ragged_all_to_all``: GPU-native, a padded all_to_all on CPU), the experts run on what they
received, and ``combine`` sends the outputs back. The result must equal the dense computation
on one device: every token through its own expert, times its gate.

The second half sends the same sorted tokens with ``jaxcoll.distributed.all_to_all_single`` and
torch's split-size tables (row r = what rank r passes), and checks it delivers the same rows.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import distributed as dist  # noqa: E402
from jaxcoll import parallel  # noqa: E402

RANKS = 4  # expert-parallel ranks (devices)
PER_RANK = 2  # experts per rank -> 8 experts
TOKENS = 16  # tokens per rank
D, HIDDEN = 8, 16  # model width, expert MLP width
EXPERTS = RANKS * PER_RANK

rng = np.random.default_rng(0)
tokens = rng.normal(size=(RANKS, TOKENS, D)).astype(np.float32)
router = rng.normal(size=(D, EXPERTS)).astype(np.float32)
w1 = (rng.normal(size=(EXPERTS, D, HIDDEN)) / np.sqrt(D)).astype(np.float32)
w2 = (rng.normal(size=(EXPERTS, HIDDEN, D)) / np.sqrt(HIDDEN)).astype(np.float32)


def route(x):
    """Top-1 routing: the expert of each token and its gate (softmax probability)."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    return jnp.argmax(probs, axis=-1), jnp.max(probs, axis=-1)


def expert_mlp(x, a, b):
    return jax.nn.gelu(x @ a) @ b


@jax.jit
def dense(x):
    """One device: every token through its own expert, times its gate."""
    expert, gate = route(x)
    y = jax.vmap(expert_mlp)(x, jnp.asarray(w1)[expert], jnp.asarray(w2)[expert])
    return y * gate[:, None]


def moe_layer(x, a, b):
    """One rank: x its (TOKENS, D) tokens, a/b its PER_RANK experts' weights."""
    expert, gate = route(x)
    # -> tokens cross to their experts' ranks (a ragged all_to_all: uneven counts)
    got, local, valid, routing = parallel.dispatch(x, expert, "ep", experts_per_rank=PER_RANK)
    y = jax.vmap(expert_mlp)(got, a[local], b[local])
    y = jnp.where(valid[:, None], y, 0.0)
    # <- outputs cross back to the tokens' ranks, in the tokens' order
    return parallel.combine(y, routing, "ep") * gate[:, None], routing.send_sizes


mesh = Mesh(np.array(jax.devices()[:RANKS]), ("ep",))
spec = NamedSharding(mesh, P("ep"))
layer = jax.jit(
    jax.shard_map(
        lambda x, a, b: jax.tree.map(lambda v: v[None], moe_layer(x[0], a, b)),
        mesh=mesh,
        in_specs=(P("ep"), P("ep"), P("ep")),
        out_specs=P("ep"),
    )
)
out, sent = layer(jax.device_put(tokens, spec), jax.device_put(w1, spec), jax.device_put(w2, spec))
sent = np.asarray(sent)
for r in range(RANKS):
    print(
        f"rank {r} sends {sent[r].tolist()} tokens to ranks 0..{RANKS - 1}, "
        f"receives {sent[:, r].tolist()}"
    )
reference = np.asarray(jax.vmap(dense)(tokens))  # on one device, rank by rank
err = float(np.abs(np.asarray(out) - reference).max())
print(f"expert-parallel MoE vs dense single-device: max abs difference {err:.2e}")
print(f"MoE equal to dense: {err < 1e-5}")

# ---- The same exchange with torch's name: dist.all_to_all_single and split-size tables.
order = [
    np.argsort(np.asarray(route(tokens[r])[0]) // PER_RANK, kind="stable") for r in range(RANKS)
]
x = dist.per_rank([tokens[r][order[r]] for r in range(RANKS)], dist.new_group(range(RANKS)))
input_split_sizes = sent.tolist()  # row r: what rank r passes to torch
output_split_sizes = sent.T.tolist()
y = dist.all_to_all_single(
    x, output_split_sizes, input_split_sizes, group=dist.new_group(range(RANKS))
)
expected = [
    np.concatenate([tokens[j][order[j]][sum(sent[j][:r]) :][: sent[j][r]] for j in range(RANKS)])
    for r in range(RANKS)
]
same = all(np.array_equal(row[: len(e)], e) for row, e in zip(dist.to_ranks(y), expected))
print(
    f"dist.all_to_all_single(x, output_split_sizes, input_split_sizes): rows as torch's: "
    f"{same}; result width {y.shape[1]} (rank r's output is row r's first "
    f"sum(output_split_sizes[r]) rows)"
)
