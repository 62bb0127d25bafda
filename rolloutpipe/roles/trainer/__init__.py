"""The trainer role: the step, its backends, the fence, checkpoints and weights over HTTP."""
