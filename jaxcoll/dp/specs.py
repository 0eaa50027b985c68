"""The spec arithmetic under :class:`~jaxcoll.dp.Layout`: where each param's *model spec*
comes from (flax's ``nn.with_partitioning`` boxes, an explicit tree, or the params' own
shardings), how a strategy's data split merges into it, and the checks that name a bad spec
and its fix.

A model spec is a ``PartitionSpec`` over the layout's model axes (tensor, pipeline) and the
expert axis: ``P(None, "tensor")`` for a column-parallel kernel, ``P("pipeline", ...)`` for
layers stacked by stage, ``P("shard", ...)`` for experts split over the data shards they
borrow. The strategy splits each leaf further over the data axes along a dimension the model
spec leaves whole (FSDP).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax.linen import meta
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .._core.typing import PyTree
from .layout import BoundLayout, is_spec


def _entries(spec: P) -> list[tuple]:
    """Each dimension's axes of ``spec`` as a tuple (empty for a whole dimension)."""
    return [() if e is None else (e if isinstance(e, tuple) else (e,)) for e in spec]


def _spec(entries: list[tuple]) -> P:
    while entries and not entries[-1]:
        entries = entries[:-1]
    return P(*[None if not e else (e[0] if len(e) == 1 else e) for e in entries])


def restrict(spec: P, axes: tuple) -> P:
    """``spec`` with only the mesh axes in ``axes`` kept (the others made whole)."""
    return _spec([tuple(a for a in e if a in axes) for e in _entries(spec)])


def used_dims(spec: P) -> frozenset[int]:
    """The dimensions ``spec`` splits."""
    return frozenset(d for d, e in enumerate(_entries(spec)) if e)


def merge(model: P, dim: int | None, data: Any) -> P:
    """The model spec ``model`` with dimension ``dim`` split over the data axis (or tuple of
    axes) ``data`` as well; ``model`` itself when ``dim`` is None. A dimension the model spec
    splits already is split model-major (the data slices inside each model slice)."""
    if dim is None:
        return model
    entries = _entries(model)
    entries += [()] * (dim + 1 - len(entries))
    entries[dim] = entries[dim] + (data if isinstance(data, tuple) else (data,))
    return _spec(entries)


def unbox(
    params: PyTree, api: str = "Trainer.init"
) -> tuple[PyTree, PyTree | None, list[Any] | None]:
    """``(params, specs, notes)``: the params without flax's ``nn.Partitioned`` boxes
    (``nn.with_partitioning``), their specs (``nn.get_partition_spec``) and, per leaf, its
    box's ``indivisible(size, n, axes)`` where it has one (:mod:`jaxcoll.nn`'s layers: the
    layer's own message for a split that does not divide); None, None when no leaf is
    boxed."""
    is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]
    for path, box in flat:
        names = getattr(box, "names", None) if isinstance(box, meta.Partitioned) else None
        if isinstance(names, str):  # nn.with_partitioning(init, "tensor"): one axis per letter
            raise TypeError(
                f"{api}: params{jax.tree_util.keystr(path)} is boxed with the names "
                f"{names!r}, a string where a tuple of axis names (one per dimension) is "
                f"expected; write nn.with_partitioning(init, ({names!r},)) to split dimension "
                f"0 over it, or (None, {names!r}) for dimension 1."
            )
    if not any(is_box(x) for _, x in flat):
        return params, None, None
    notes = [getattr(x, "indivisible", None) for _, x in flat]
    return meta.unbox(params), meta.get_partition_spec(params), notes


def _resolve(spec: P, table: Any, mesh: Mesh, unknown: Any = None) -> P:
    """``spec`` with each role or logical axis (``"tensor"``, ``"heads"``, ``"layers"``) made
    the layout's mesh axis for it, or whole where the layout gives it none; a mesh axis's own
    name stays. A name that is neither calls ``unknown(name)`` (which raises)."""

    def one(name: Any) -> tuple:
        if name in mesh.axis_names:
            return (name,)
        if name not in table:
            if unknown is not None:
                unknown(name)
            return (name,)
        return () if table[name] is None else (table[name],)

    return _spec([tuple(a for n in e for a in one(n)) for e in _entries(spec)])


def _unknown_name(api: str, layout: BoundLayout) -> Any:
    """The error for a name in a model spec that is no mesh axis, role or logical axis."""

    def raise_(name: Any) -> None:
        raise ValueError(
            f"{api}: a param's sharding names {name!r}, which is no axis of the mesh "
            f"{tuple(layout.mesh.axis_names)}, no role and no logical axis the layout knows "
            f"({sorted(k for k in layout.binding.axes if k != 'batch')}). Map it in the "
            f"layout: dp.Layout(..., rules={{{name!r}: 'tensor'}}) for a tensor-parallel "
            f"split (or 'pipeline', 'expert'), or rules={{{name!r}: None}} to keep that "
            f"dimension whole (a data axis's name: the strategy splits the data axes)."
        )

    return raise_


def is_rules(specs: Any) -> bool:
    """``specs`` is a sequence of ``(regex, PartitionSpec)`` partition rules."""
    return (
        isinstance(specs, (list, tuple))
        and len(specs) > 0
        and all(
            isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str) and is_spec(r[1])
            for r in specs
        )
    )


def path_name(path: tuple) -> str:
    """A param's path as partition rules match it: its keys joined by ``/``
    (``"layers/0/attention/q/kernel"``)."""
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        parts.append(str(key))
    return "/".join(parts)


def from_rules(api: str, rules: Any, params: PyTree) -> PyTree:
    """Each param's spec by partition rules (EasyLM's and t5x's ``match_partition_rules``):
    the spec of the first rule whose regex ``re.search``-matches the param's path
    (:func:`path_name`); a scalar is whole. A param no rule matches raises, naming its path."""
    import re

    compiled = []
    for pattern, spec in rules:
        try:
            compiled.append((re.compile(pattern), spec))
        except re.error as e:
            raise ValueError(f"{api}: the partition rule {pattern!r} is no regex: {e}.") from e

    def one(path: tuple, leaf: Any) -> P:
        name = path_name(path)
        if not getattr(leaf, "shape", ()):
            return P()
        for regex, spec in compiled:
            if regex.search(name):
                return P() if spec is None else spec
        raise ValueError(
            f"{api}: no partition rule matches the param {name!r} (shape "
            f"{tuple(leaf.shape)}); add a rule for it, or a last catch-all (r'.*', P())."
        )

    return jax.tree_util.tree_map_with_path(one, params)


def _not_a_spec(api: str, path: str, value: Any) -> None:
    """Raise TypeError for a leaf of a specs tree that is not a ``PartitionSpec`` (nor None)."""
    if isinstance(value, str):
        raise TypeError(
            f"{api}: specs{path} is the string {value!r}, where a PartitionSpec is expected "
            f"(a string is not read as an axis name: P(*{value!r}) would split one dimension "
            f"per letter); write P({value!r}) to split dimension 0 over it, or P(None, "
            f"{value!r}) for dimension 1."
        )
    raise TypeError(
        f"{api}: specs{path} is {value!r} (a {type(value).__name__}), where a PartitionSpec "
        f"is expected; write one PartitionSpec per param, e.g. P(None, 'tensor'), or None "
        f"for a whole param."
    )


def model_specs(
    api: str,
    params: PyTree,
    specs: PyTree | None,
    layout: BoundLayout,
    notes: list[Any] | None = None,
) -> list[P]:
    """Per leaf of ``params``, its model spec over the axes of the bound ``layout``, checked.

    From ``specs`` (a tree of ``PartitionSpec`` shaped like ``params``) when given, else from
    each leaf's own ``NamedSharding`` (its data axes dropped: a state the Trainer placed).
    A name that is no axis of the mesh is dropped (a model written for a tensor axis, run on
    a mesh without one, runs dense); a mesh axis that is neither a data axis nor one of the
    layout's raises, naming the leaf and the fix; so does a split that does not divide (in
    the words of the leaf's layer where ``notes``, from :func:`unbox`, has them).
    """
    mesh, data_axes = layout.mesh, layout.data_axes
    leaves = jax.tree_util.tree_leaves(params)
    if specs is None:
        found = [getattr(getattr(x, "sharding", None), "spec", None) for x in leaves]
        given = [P() if s is None else s for s in found]
        source = "is placed"
    else:
        flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
        for key, s in flat:
            if not is_spec(s):
                _not_a_spec(api, jax.tree_util.keystr(key), s)
        given = [P() if s is None else s for _, s in flat]
        if len(given) != len(leaves):
            raise ValueError(
                f"{api}: specs has {len(given)} PartitionSpecs for {len(leaves)} params; "
                f"pass one per leaf of params (a tree of the same structure)."
            )
        source = "has the spec"
    table = layout.binding.axes
    unknown = _unknown_name(api, layout)
    raw = given
    given = [_resolve(spec, table, mesh, unknown) for spec in given]
    out = []
    for i, (leaf, spec) in enumerate(zip(leaves, given, strict=True)):
        used = [a for e in _entries(spec) for a in e]
        stray = [a for a in used if a in mesh.axis_names and a not in data_axes + layout.axes]
        if stray or len(_entries(spec)) > len(getattr(leaf, "shape", ())):
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][i][0])
            shown = "P(" + ", ".join(repr(e) for e in spec) + ")"
            if stray:
                raise ValueError(
                    f"{api}: params{path} {source} {shown}, split over the mesh axis "
                    f"{stray[0]!r}, which has no role in this Trainer (data axes "
                    f"{data_axes}, layout {layout.layout!r}); the Trainer would gather it "
                    f"whole on every device. Name the axis in the layout (dp.Layout(tensor="
                    f"{stray[0]!r}) for a tensor-parallel split) or pass the leaf "
                    f"replicated over it."
                )
            raise ValueError(
                f"{api}: params{path} {source} {shown}, with more entries than its "
                f"{len(leaf.shape)} dimensions; give one entry per dimension at most."
            )
        kept = restrict(spec, layout.param_axes if specs is not None else layout.axes)
        for d, e in enumerate(_entries(kept)):
            k = 1
            for a in e:
                k *= mesh.shape[a]
            if leaf.shape[d] % k:
                path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][i][0])
                said = notes[i](leaf.shape[d], k, e) if notes and notes[i] else None
                if said:  # the layer's words: its argument that the axis does not divide
                    raise ValueError(
                        f"{api}: {said} (params{path}, of shape {tuple(leaf.shape)}, is split "
                        f"over it along dimension {d}.)"
                    )
                names = [n for n in (_entries(raw[i]) + [()] * d)[d] if n in table]
                keep = (
                    f" or keep that dimension whole: dp.Layout(..., rules={{{names[0]!r}: "
                    f"None}}) (a model written for GSPMD then computes it whole on every "
                    f"device of {e[0]!r}: Megatron's and MaxText's answer to fewer kv heads "
                    f"than tensor ranks)"
                    if names
                    else ""
                )
                raise ValueError(
                    f"{api}: params{path} (shape {tuple(leaf.shape)}) is split over {e} "
                    f"along dimension {d}, of size {leaf.shape[d]}, which {k} devices do not "
                    f"divide. Pick sizes the model axes divide{keep}."
                )
        out.append(kept)
    return out


def check_placed_specs(api: str, params: Any, found: list[P], known: Sequence[P]) -> None:
    """Raise if a leaf of ``params`` is placed over the model axes (``found``, one spec per
    leaf) otherwise than the Trainer's model spec for it (``known``) says: the step would
    silently place it as ``known`` says."""
    if len(found) != len(known):
        raise ValueError(
            f"{api}: these params have {len(found)} leaves, and the params this Trainer "
            f"was initialised with {len(known)}; with model axes a Trainer "
            f"trains the model it was initialised with (call init with these params)."
        )
    for i, (got, want) in enumerate(zip(found, known, strict=True)):
        if got != want and got != P():
            path = jax.tree_util.tree_flatten_with_path(params)[0][i][0]
            raise ValueError(
                f"{api}: params{jax.tree_util.keystr(path)} is placed {got} over the "
                f"model axes, but this Trainer was initialised with the model spec "
                f"{want} for it; the step would place it as {want}, not as the model "
                f"that split it expects. Pass init the params with their model specs "
                f"(boxed by nn.with_partitioning, specs=..., or placed), or pass this "
                f"leaf placed as {want}."
            )
