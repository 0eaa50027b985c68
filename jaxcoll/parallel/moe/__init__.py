"""Mixtures of experts, functional: the one entry :func:`moe_mlp` and what a custom layer
calls on its own.

* :mod:`.mlp`: :func:`moe_mlp`, the entry (its argument checks, then the parts below);
* :mod:`.router`: top-k routing and the per-sequence capacity;
* :mod:`.exchange`: :func:`dispatch` and :func:`combine`, the tokens' ragged all-to-alls to
  the experts' ranks and back;
* :mod:`.experts`: the local experts' grouped matmuls (``jax.lax.ragged_dot``);
* :mod:`.metrics`: :class:`Load` (the load over the whole batch and the load-balancing
  loss) and :func:`moe_metrics`.

The flax layer is :class:`jaxcoll.nn.MoE`: its params, then one call to :func:`moe_mlp`'s
body.
"""

from .exchange import combine as combine
from .exchange import dispatch as dispatch
from .metrics import Load as Load
from .metrics import moe_metrics as moe_metrics
from .mlp import moe_mlp as moe_mlp

__all__ = [
    "Load",
    "combine",
    "dispatch",
    "moe_metrics",
    "moe_mlp",
]
