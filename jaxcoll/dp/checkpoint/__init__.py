"""Checkpoints that restore into any layout: :class:`~jaxcoll.dp.Checkpointer`
(:mod:`.checkpointer`), with whether a template matches a saved step (:mod:`._match`), the
processes' meeting point before each save or restore (:mod:`._rendezvous`) and the commit's
barrier (:mod:`._commit`)."""
