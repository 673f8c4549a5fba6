"""Reverse-process samplers: ancestral DDPM (respaced for S < T steps) and DDIM with eta.

Both walk the "leading" timestep subsequence range(0, T, T // S)[:S] from the end to t = 0, call the
model with those original timesteps, and add no noise at the last step (after which alpha_bar = 1).
"""
import contextlib
import math

import numpy as np
from tqdm import tqdm

import megengine.functional as F


def timestep_subsequence(num_timesteps, steps=None):
    """The S original timesteps range(0, T, T // S)[:S] (all T when steps is None)."""
    if steps is None:
        steps = num_timesteps
    if int(steps) != steps or not 1 <= steps <= num_timesteps:
        raise ValueError(f"steps must be an integer between 1 and T={num_timesteps}, got {steps}")
    steps = int(steps)
    return np.arange(0, num_timesteps, num_timesteps // steps)[:steps]


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


def _steps(timesteps, progress):
    return tqdm(range(len(timesteps) - 1, -1, -1), total=len(timesteps), disable=not progress, leave=False)


def _full(n, value):
    return F.full((n,), int(value), dtype="int32")


def ddpm_sample(diffusion, model, x, timesteps, clip_denoised, draw_noise, progress):
    """Ancestral sampling: x_{t-1} = posterior mean at the predicted x_0 + exp(log var / 2) * noise.

    For a subsequence of timesteps the chain is respaced (``GaussianDiffusion.respace``): betas are
    recomputed from alphas_cumprod at the kept timesteps, the model still sees the original ones.
    """
    chain = diffusion if len(timesteps) == diffusion.num_timesteps else diffusion.respace(timesteps)
    n = x.shape[0]
    for i in _steps(timesteps, progress):
        x0, _ = diffusion.model_predictions(model, x, _full(n, timesteps[i]), clip_denoised)
        x = chain.q_posterior_mean(x0, x, _full(n, i))
        if i > 0:
            x = x + math.exp(0.5 * chain.model_log_variance[i]) * draw_noise()
    return x


def ddim_sample(diffusion, model, x, timesteps, eta, clip_denoised, draw_noise, progress):
    """DDIM (Song et al. 2021, eq. 12): x_prev = sqrt(a_prev) x_0 + sqrt(1 - a_prev - sigma^2) eps
    + sigma noise, with sigma = eta * sqrt((1 - a_prev) / (1 - a)) * sqrt(1 - a / a_prev) (eq. 16) and
    a = alpha_bar at the current timestep, a_prev at the previous kept one (1 after the last)."""
    alphas_cumprod = diffusion.alphas_cumprod
    n = x.shape[0]
    for i in _steps(timesteps, progress):
        x0, eps = diffusion.model_predictions(model, x, _full(n, timesteps[i]), clip_denoised)
        a = alphas_cumprod[timesteps[i]]
        a_prev = alphas_cumprod[timesteps[i - 1]] if i > 0 else 1.0
        sigma = eta * math.sqrt((1 - a_prev) / (1 - a)) * math.sqrt(1 - a / a_prev)
        x = math.sqrt(a_prev) * x0 + math.sqrt(max(1 - a_prev - sigma ** 2, 0.0)) * eps
        if sigma > 0:
            x = x + sigma * draw_noise()
    return x
