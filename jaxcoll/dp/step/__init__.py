"""The step program: the Trainer's loss in its one form (:mod:`.loss`), the jitted step and
evaluation built from a loss, a strategy and a bound layout (:mod:`.build`), and the first state
placed on the mesh (:mod:`.placement`)."""
