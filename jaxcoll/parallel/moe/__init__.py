"""Mixtures of experts, functional: the one entry :func:`moe_mlp` and what a custom layer
calls on its own.

* :mod:`.mlp`: :func:`moe_mlp`, the entry (its argument checks, then the parts below);
* :mod:`.router`: top-k routing and the per-sequence capacity;
* :mod:`.exchange`: :func:`dispatch` and :func:`combine`, the tokens' ragged all-to-alls to
  the experts' ranks and back;
* :mod:`.hierarchical`: :func:`hierarchical_dispatch` and :func:`hierarchical_combine`, the
  two-level exchange over an expert axis split across and within processes (each token
  crosses between nodes once per destination node);
* :mod:`.experts`: the local experts' grouped matmuls (``jax.lax.ragged_dot``);
* :mod:`.metrics`: :class:`Load` (the load over the whole batch and the load-balancing
  loss), :func:`moe_metrics`, and :func:`update_expert_bias` (aux-loss-free balancing's
  step of the routing bias).

The flax layer is :class:`jaxcoll.nn.MoE`: its params, then one call to :func:`moe_mlp`'s
body.
"""

from .exchange import combine as combine
from .exchange import dispatch as dispatch
from .hierarchical import hierarchical_combine as hierarchical_combine
from .hierarchical import hierarchical_dispatch as hierarchical_dispatch
from .metrics import Load as Load
from .metrics import moe_metrics as moe_metrics
from .metrics import update_expert_bias as update_expert_bias
from .mlp import moe_mlp as moe_mlp

__all__ = [
    "Load",
    "combine",
    "dispatch",
    "hierarchical_combine",
    "hierarchical_dispatch",
    "moe_metrics",
    "moe_mlp",
    "update_expert_bias",
]
