"""Training: config (``TrainConfig``), ``Trainer`` and the loop, checkpoints, distributed launch, and the
run's outputs (``outputs``: metrics, sample grids, run files)."""
