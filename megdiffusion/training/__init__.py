"""Training: config (``TrainConfig``), ``Trainer`` and the loop, checkpoints, distributed launch, logging."""
