"""Collective algorithms: native, ring, tree, hierarchical, and ``auto``.

Pick one with ``algorithm=`` on :func:`~jaxcoll.primitives.all_reduce`,
:func:`~jaxcoll.primitives.reduce`, :func:`~jaxcoll.primitives.broadcast`,
:func:`~jaxcoll.primitives.all_gather` and :func:`~jaxcoll.primitives.reduce_scatter`:

* ``"native"``: the lax collective (HLO all-reduce etc.; NCCL on GPU);
* ``"ring"``: bandwidth-optimal: 2(n-1) neighbour steps of 1/n of the data (all-reduce);
* ``"tree"``: latency-optimal: recursive doubling / binomial tree / Bruck, ~log2(n) steps;
* ``"hierarchical"``: over a tuple axis (outer, inner): inside, 1/inner across, inside again;
* ``"auto"``: the default: the measured winner for platform, op and size (``choose``).

``auto`` reads the table shipped as package data (``auto_table.json``) merged with the user's
file (:func:`user_table_path`, written by ``jaxcoll-bench --update-table``); see
:mod:`.auto`.

Every algorithm supports every reduce op and dtype the primitive does, any group size, sizes
not divisible by n, pytrees (leaves of one dtype are reduced as one buffer), ``jax.jit`` and
``jax.grad``. Results that are equal on every rank (all-reduce, broadcast, all-gather) are
typed invariant by every algorithm. This layer builds on :mod:`jaxcoll._core` only; the
public primitives call it through :mod:`.registry`.
"""

from . import hierarchical as hierarchical
from . import native as native
from . import ring as ring
from . import tree as tree
from .auto import OPS as OPS
from .auto import choose as choose
from .auto import load_table as load_table
from .auto import table_from_results as table_from_results
from .auto import user_table_path as user_table_path
from .registry import ALGORITHMS as ALGORITHMS

__all__ = [
    "ALGORITHMS",
    "OPS",
    "choose",
    "hierarchical",
    "load_table",
    "native",
    "ring",
    "table_from_results",
    "tree",
    "user_table_path",
]
