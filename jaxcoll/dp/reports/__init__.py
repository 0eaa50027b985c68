"""What a run reports: the step metrics (:mod:`.metrics`), TensorBoard event files
(:mod:`.tensorboard`) and plots of the history and of a profile trace (:mod:`.plot`)."""
