"""Reverse-process samplers: ancestral DDPM and DDIM with eta, each a loop over the single steps of
``GaussianDiffusion`` (``p_sample_step``, ``ddim_step``).

Both run on a chain already respaced to the kept timesteps (``GaussianDiffusion.respaced``), from its last index
to 0; the chain calls the model with the original timesteps. After the last step alpha_bar is 1 and no noise is
added. Noise is drawn only for steps that add it (``draw_noise()``), so per-image seeds give the same images as
before learned variances existed.
"""
import contextlib

from megdiffusion.progress import progress_bar

import megengine.functional as F


@contextlib.contextmanager
def eval_mode(model):
    """Run the block with ``model`` in eval mode (dropout off), restoring its previous mode after."""
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()
    try:
        yield
    finally:
        if was_training:
            model.train()


def _reverse_indices(num_steps, progress):
    """num_steps - 1, ..., 0, with a tqdm bar when ``progress``."""
    return progress_bar(range(num_steps - 1, -1, -1), total=num_steps, disable=not progress, leave=False)


def _full(n, value):
    return F.full((n,), int(value), dtype="int32")


def ddpm_sample(chain, model, x, clip_denoised, draw_noise, progress):
    """Ancestral sampling: x_{t-1} = the model's mean + exp(log variance / 2) * noise (no noise at t = 0)."""
    for i in _reverse_indices(chain.num_timesteps, progress):
        x, _ = chain.p_sample_step(model, x, _full(x.shape[0], i), clip_denoised, draw_noise() if i > 0 else None)
    return x


def ddim_sample(chain, model, x, eta, clip_denoised, draw_noise, progress):
    """DDIM (``GaussianDiffusion.ddim_step``); noise is drawn only when eta > 0 and the step is not the last."""
    for i in _reverse_indices(chain.num_timesteps, progress):
        noise = draw_noise() if eta > 0 and i > 0 else None
        x, _ = chain.ddim_step(model, x, _full(x.shape[0], i), eta, clip_denoised, noise)
    return x
