"""Training: DeepSpeed engine setup, the fit loop and its callbacks, checkpoints, tracking."""
