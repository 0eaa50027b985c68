"""The host loop of :meth:`Trainer.fit <jaxcoll.dp.Trainer.fit>`: its entry point and arguments
(:mod:`.fit`, :mod:`.args`), the loop itself (:mod:`.runner`), its components
(:mod:`.components`) and evaluation (:mod:`.evaluate`, the one home of
:meth:`Trainer.evaluate <jaxcoll.dp.Trainer.evaluate>`'s exact means)."""
