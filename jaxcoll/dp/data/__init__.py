"""Global batches: :class:`~jaxcoll.dp.Batches` of in-memory arrays (:mod:`.batches`) and token
files read through grain, each process reading its own rows (:mod:`.grain`)."""
