"""The ground layer: what every collective is built from. Imports nothing of jaxcoll above it.

* :mod:`.typing`: the ``PyTree`` and ``AxisName`` aliases;
* :mod:`.ops`: :class:`ReduceOp`, which dtypes each op allows, and the one op table (fold);
* :mod:`.checks`: argument checkers whose messages name the op, the argument, the value, the fix;
* :mod:`.axis`: resolving ``axis_name`` inside shard_map;
* :mod:`.vma`: shard_map's varying/invariant types (widening, the replicated cast);
* :mod:`.packing`: flat buffers, padding to rows, bit views;
* :mod:`.lowering`: the native per-leaf lowerings (one lax collective each where lax has one);
* :mod:`.protocol`: how an object passed as ``axis_name`` (a group) runs a collective itself.
"""
