"""The random draws of one training step, as functions of the seed, the step and the samples' place in the batch.

No generator state is saved: a checkpoint records which scheme its run draws with (``checkpoint.snapshot``) and
the step count, and a resumed run draws exactly what it would have drawn.

- ``PER_SAMPLE`` (runs started since the scheme was recorded as it): sample ``i`` of the global batch of step
  ``k`` draws its timestep, noise, input perturbation and class-dropout coin from
  ``default_rng([seed, k, i, SAMPLE_STREAM])``. A rank holding samples ``first..first+n`` of the global batch
  draws exactly those, so 1 rank, N ranks or 1 rank in micro-batches see the same step.
- ``PER_RANK`` (earlier runs): rank ``r`` draws its whole share from ``default_rng([seed, r, k])``: the same
  recipe on N ranks matches one rank only in distribution.

Dropout's masks come from MegEngine's global RNG (the MegEngine step) or numpy (the numpy pass), seeded with the
step's ``dropout_seed``: under ``PER_SAMPLE`` a function of (seed, step, the rank's first sample), so ranks draw
different masks. They also depend on how the batch is cut, see ``Trainer.step``.
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megdiffusion.data.loader import per_rank_batch
from megdiffusion.nn.options import NO_CLASS

PER_SAMPLE = "numpy default_rng([seed, step, sample index in the global batch, 0])"
PER_RANK = "numpy default_rng([seed, rank, step])"
SCHEMES = (PER_SAMPLE, PER_RANK)
SAMPLE_STREAM, DROPOUT_STREAM = 0, 1  # the last word of a PER_SAMPLE generator's seed


@dataclass
class StepDraws:
    """What one step draws for a rank's samples: timesteps ``t`` (int32, (N,)), ``noise`` (float32, like x0),
    ``perturbation`` (like noise, or None), class ``labels`` after class dropout (or None), ``dropout_seed``."""

    t: np.ndarray
    noise: np.ndarray
    perturbation: Optional[np.ndarray]
    labels: Optional[np.ndarray]
    dropout_seed: int

    def piece(self, rows):
        """The draws of the samples ``rows`` (a slice): a micro-batch (same ``dropout_seed``)."""
        return StepDraws(self.t[rows], self.noise[rows], _rows(self.perturbation, rows), _rows(self.labels, rows),
                         self.dropout_seed)


def first_sample(global_batch, world_size, rank):
    """The place in the global batch of rank ``rank``'s first sample: ranks hold equal contiguous shares of it, in
    rank order (``data.loader.BatchLoader``)."""
    return rank * per_rank_batch(global_batch, world_size)


def _rows(array, rows):
    return None if array is None else array[rows]


def draw_step(scheme, cfg, num_timesteps, step, shape, labels=None, rank=0, first_index=0):
    """The ``StepDraws`` of step ``step`` for a rank's batch of ``shape`` (N, C, H, W): samples ``first_index`` ..
    ``first_index + N - 1`` of the global batch (``PER_SAMPLE``) or rank ``rank``'s share (``PER_RANK``).
    ``labels``: the batch's class labels for a class-conditional run (replaced by ``NO_CLASS`` with probability
    ``cfg.class_dropout``)."""
    if scheme == PER_SAMPLE:
        return _per_sample(cfg, num_timesteps, step, shape, labels, first_index)
    if scheme == PER_RANK:
        return _per_rank(cfg, num_timesteps, step, shape, labels, rank)
    raise ValueError(f"unknown random-draw scheme {scheme!r}; known: {', '.join(SCHEMES)}")


def _per_sample(cfg, num_timesteps, step, shape, labels, first_index):
    n = shape[0]
    t = np.empty(n, np.int32)
    noise = np.empty(shape, np.float32)
    perturbation = np.empty(shape, np.float32) if cfg.input_perturbation else None
    dropped = np.zeros(n, bool)
    for row in range(n):
        rng = np.random.default_rng([cfg.seed, step, first_index + row, SAMPLE_STREAM])
        t[row] = rng.integers(0, num_timesteps)
        noise[row] = rng.standard_normal(shape[1:], dtype=np.float32)
        if perturbation is not None:
            perturbation[row] = np.float32(cfg.input_perturbation) * rng.standard_normal(shape[1:], dtype=np.float32)
        dropped[row] = rng.random() < cfg.class_dropout
    if cfg.class_dropout and labels is not None:
        labels = np.where(dropped, NO_CLASS, labels).astype(labels.dtype)
    dropout_seed = int(np.random.default_rng([cfg.seed, step, first_index, DROPOUT_STREAM]).integers(2 ** 31))
    return StepDraws(t, noise, perturbation, labels, dropout_seed)


def _per_rank(cfg, num_timesteps, step, shape, labels, rank):
    rng = np.random.default_rng([cfg.seed, rank, step])
    t = rng.integers(0, num_timesteps, size=shape[0]).astype(np.int32)
    noise = rng.standard_normal(shape, dtype=np.float32)
    dropout_seed = int(rng.integers(2 ** 31))
    perturbation = (np.float32(cfg.input_perturbation) * rng.standard_normal(shape, dtype=np.float32)
                    if cfg.input_perturbation else None)
    if cfg.class_dropout and labels is not None:
        labels = np.where(rng.random(shape[0]) < cfg.class_dropout, NO_CLASS, labels).astype(labels.dtype)
    return StepDraws(t, noise, perturbation, labels, dropout_seed)
