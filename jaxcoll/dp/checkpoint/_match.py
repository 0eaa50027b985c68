"""Does a template match a saved checkpoint? The comparison :class:`~jaxcoll.dp.Checkpointer`
makes before it restores: the structure, shapes and dtypes of a template against the metadata
tree orbax saved, and the hook state's own rule. A template that does not match is the
caller's mistake, named as such, never a damaged checkpoint."""

from __future__ import annotations

from typing import Any

import jax

from ..state import TrainState


def _leaf_table(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``path -> (shape, dtype)`` of every leaf, paths written alike for a live tree and
    orbax's metadata tree (a list index and a dict key both as their plain text)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    table = {}
    for path, leaf in flat:
        keys = "/".join(
            str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path
        )
        table[keys] = (tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", "")))
    return table


def check_template(api: str, template: Any, saved: dict, step: int, directory: str) -> None:
    """Raise if ``template`` cannot receive the checkpoint whose metadata tree is ``saved``.

    Compares the structure (the leaves' paths) and each leaf's shape and dtype, the hook
    state (``comm_state``) apart: it has its own rule (:func:`comm_mismatch`). A template
    that does not match is a caller's mistake, never a damaged checkpoint: the message says
    what differs and that the checkpoints are intact.
    """
    where = f"the checkpoint of step {step} in {directory}"
    intact = "nothing was restored, and the checkpoints are intact: do not remove them"
    if not isinstance(template, TrainState):
        given = _leaf_table(template)
        raise TypeError(
            f"{api}: template must be the whole dp.TrainState that {where} holds "
            f"({', '.join(sorted(saved))}), got a {type(template).__name__} instead (leaves "
            f"{_some(given)}); {intact}. Pass the state the run trains: "
            f"trainer.init(params, rng), not the params alone."
        )
    old = {k: v for k, v in _leaf_table(saved).items() if not k.startswith("comm_state/")}
    new = {k: v for k, v in _leaf_table(template).items() if not k.startswith("comm_state/")}
    if old == new:
        return
    diffs = []
    for k in (k for k in new if k in old):  # in the template's order: params first
        (s_shape, s_dtype), (g_shape, g_dtype) = old[k], new[k]
        if s_shape != g_shape or s_dtype != g_dtype:
            diffs.append(f"{k}: saved {s_shape} {s_dtype}, given {g_shape} {g_dtype}")
    parts = []
    if diffs:
        more = f" (and {len(diffs) - 3} more leaves)" if len(diffs) > 3 else ""
        parts.append("; ".join(diffs[:3]) + more)
    only_saved, only_given = old.keys() - new.keys(), new.keys() - old.keys()
    if only_saved:
        parts.append(f"leaves saved but not in the template: {_some(only_saved)}")
    if only_given:
        parts.append(f"leaves in the template but not saved: {_some(only_given)}")
    raise ValueError(
        f"{api}: the template does not match {where} (read from its metadata; {intact}): "
        f"{'; '.join(parts)}. Build the template with the model, optimizer and strategy of "
        f"the run that saved it (trainer.init(params, rng)), or start a changed model in a "
        f"new directory."
    )


def _some(keys: Any, n: int = 4) -> str:
    """Up to ``n`` of ``keys``, sorted, with how many more."""
    keys = sorted(keys)
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more if keys else "none"


def comm_mismatch(saved: Any, fresh: Any) -> str | None:
    """Why the saved hook state cannot go into ``fresh``'s place, or None if it can."""
    old, new = _leaf_table(saved), _leaf_table(fresh)
    if old == new:
        return None
    if not new:
        return "this Trainer's strategy has no hook state (its hook differs from the saved one)"
    if not old:
        return "the checkpoint holds none (it was written without this hook)"
    lead = {k: (v[0][0] if v[0] else None) for k, v in old.items()}
    now = {k: (v[0][0] if v[0] else None) for k, v in new.items()}
    if old.keys() != new.keys():
        return "its structure differs from this Trainer's hook state (another hook or buckets)"
    a, b = set(lead.values()), set(now.values())
    if len(a) == 1 and len(b) == 1 and a != b:
        return f"was written for {a.pop()} ranks, and this Trainer has {b.pop()}"
    return "its shapes or dtypes differ from this Trainer's hook state"
