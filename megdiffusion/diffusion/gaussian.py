"""Gaussian diffusion (Ho et al. 2020): forward process, posterior, model predictions, training loss.

Timesteps t are integers 0..T-1 (t = 0 is the first noising step). Tensors are NCHW (or any (N, ...)).
The schedule arrays are float64 numpy, computed once; the ones needed per sample are moved to float32
tensors once, in ``__init__``. The model is passed to each call, never stored.
"""
import math

import numpy as np

import megengine
import megengine.functional as F
from megengine import Tensor

from megdiffusion.diffusion import samplers
from megdiffusion.diffusion.choices import MEAN_TYPES, SAMPLERS, VAR_TYPES

# Arrays gathered per sample at timestep t (moved to float32 tensors once).
_PER_SAMPLE = (
    "sqrt_alphas_cumprod",
    "sqrt_one_minus_alphas_cumprod",
    "sqrt_recip_alphas_cumprod",
    "sqrt_recipm1_alphas_cumprod",
    "posterior_mean_coef1",
    "posterior_mean_coef2",
)


def _as_timesteps(t):
    return t.astype("int32") if isinstance(t, Tensor) else Tensor(np.asarray(t), dtype="int32")


class GaussianDiffusion:
    """The DDPM forward process q(x_t | x_0) and the reverse-process arithmetic around a model.

    :param betas: 1-D float array of the forward-process variances, each in (0, 1).
    :param mean_type: "eps" (the paper's choice), "xstart" or "xprev": what ``model(x_t, t)`` predicts.
    :param var_type: "fixedlarge" (beta_t, with the posterior variance at t = 0, the official CIFAR-10
        choice) or "fixedsmall" (the posterior variance, clipped at t = 0).
    """

    def __init__(self, betas, mean_type="eps", var_type="fixedlarge"):
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or len(betas) < 2:
            raise ValueError(f"betas must be a 1-D array of at least 2 values, got shape {betas.shape}")
        if not ((betas > 0) & (betas < 1)).all():
            raise ValueError("betas must all lie strictly between 0 and 1")
        if mean_type not in MEAN_TYPES:
            raise ValueError(f"unknown mean_type {mean_type!r}; choose one of {', '.join(MEAN_TYPES)}")
        if var_type not in VAR_TYPES:
            raise ValueError(f"unknown var_type {var_type!r}; choose one of {', '.join(VAR_TYPES)}")
        self.mean_type = mean_type
        self.var_type = var_type
        self.num_timesteps = len(betas)

        self.betas = betas
        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1.0)
        # q(x_{t-1} | x_t, x_0) = N(coef1 * x_0 + coef2 * x_t, posterior_variance)   (paper eq. 6-7)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # The variance is 0 at t = 0: its log is clipped to the value at t = 1.
        self.posterior_log_variance_clipped = np.log(
            np.append(self.posterior_variance[1], self.posterior_variance[1:])
        )
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (
            (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)
        )
        if var_type == "fixedlarge":
            # Ho's code: beta_t, except posterior_variance[1] at t = 0 (a better decoder variance there).
            self.model_log_variance = np.log(np.append(self.posterior_variance[1], betas[1:]))
        else:
            self.model_log_variance = self.posterior_log_variance_clipped

        self._tensors = {name: Tensor(getattr(self, name).astype(np.float32)) for name in _PER_SAMPLE}

    def _extract(self, name, t, ndim):
        """The named array at timesteps t (shape (N,)), shaped (N, 1, ..., 1) to broadcast over ndim dims."""
        return self._tensors[name][t].reshape((-1,) + (1,) * (ndim - 1))

    def q_sample(self, x0, t, noise):
        """Draw x_t ~ q(x_t | x_0): sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) noise."""
        t = _as_timesteps(t)
        return (self._extract("sqrt_alphas_cumprod", t, x0.ndim) * x0
                + self._extract("sqrt_one_minus_alphas_cumprod", t, x0.ndim) * noise)

    def q_posterior_mean(self, x0, x_t, t):
        """Mean of q(x_{t-1} | x_t, x_0)."""
        t = _as_timesteps(t)
        return (self._extract("posterior_mean_coef1", t, x_t.ndim) * x0
                + self._extract("posterior_mean_coef2", t, x_t.ndim) * x_t)

    def predict_xstart_from_eps(self, x_t, t, eps):
        """x_0 = (x_t - sqrt(1 - alpha_bar_t) eps) / sqrt(alpha_bar_t)."""
        return (self._extract("sqrt_recip_alphas_cumprod", t, x_t.ndim) * x_t
                - self._extract("sqrt_recipm1_alphas_cumprod", t, x_t.ndim) * eps)

    def predict_eps_from_xstart(self, x_t, t, x0):
        """The eps that, with x_t, gives x0 (the inverse of ``predict_xstart_from_eps``)."""
        return ((self._extract("sqrt_recip_alphas_cumprod", t, x_t.ndim) * x_t - x0)
                / self._extract("sqrt_recipm1_alphas_cumprod", t, x_t.ndim))

    def predict_xstart_from_xprev(self, x_t, t, xprev):
        """The x_0 whose posterior mean, with x_t, is xprev."""
        return ((xprev - self._extract("posterior_mean_coef2", t, x_t.ndim) * x_t)
                / self._extract("posterior_mean_coef1", t, x_t.ndim))

    def model_predictions(self, model, x_t, t, clip_denoised=True):
        """Run ``model(x_t, t)`` and return (x_0, eps) predictions, whatever the mean type.

        With ``clip_denoised`` x_0 is clipped to [-1, 1] and eps is re-derived from the clipped x_0.
        """
        t = _as_timesteps(t)
        out = model(x_t, t)
        if self.mean_type == "eps":
            x0 = self.predict_xstart_from_eps(x_t, t, out)
        elif self.mean_type == "xstart":
            x0 = out
        else:
            x0 = self.predict_xstart_from_xprev(x_t, t, out)
        if clip_denoised:
            x0 = F.clip(x0, -1.0, 1.0)
        if self.mean_type == "eps" and not clip_denoised:
            return x0, out
        return x0, self.predict_eps_from_xstart(x_t, t, x0)

    def training_loss(self, model, x0, t=None, noise=None):
        """Per-sample MSE (shape (N,)) between the model output at x_t ~ q(x_t | x_0) and its target
        (the noise, x_0 or the posterior mean, by mean type). t defaults to uniform draws from 0..T-1
        and noise to standard normal, both from MegEngine's global RNG."""
        n = x0.shape[0]
        if t is None:
            t = F.minimum(F.floor(megengine.random.uniform(0, self.num_timesteps, size=(n,))),
                          self.num_timesteps - 1)
        t = _as_timesteps(t)
        if noise is None:
            noise = megengine.random.normal(size=x0.shape)
        x_t = self.q_sample(x0, t, noise)
        out = model(x_t, t)
        if self.mean_type == "eps":
            target = noise
        elif self.mean_type == "xstart":
            target = x0
        else:
            target = self.q_posterior_mean(x0, x_t, t)
        return ((out - target) ** 2).reshape(n, -1).mean(axis=1)

    def respace(self, timesteps):
        """The diffusion over the increasing subsequence ``timesteps`` of this one: betas recomputed so
        that its alphas_cumprod are this chain's alphas_cumprod at those timesteps."""
        alphas_cumprod = self.alphas_cumprod[np.asarray(timesteps)]
        betas = 1.0 - alphas_cumprod / np.append(1.0, alphas_cumprod[:-1])
        return GaussianDiffusion(betas, self.mean_type, self.var_type)

    def check_sampling(self, sampler, steps=None, eta=0.0):
        """Raise ValueError (one line) unless ``sample`` accepts this sampler, step count and eta."""
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
        if not (math.isfinite(eta) and eta >= 0) or (eta and sampler != "ddim"):
            raise ValueError(f"eta must be a finite number >= 0 and is only used by the ddim sampler, got eta={eta}")
        samplers.timestep_subsequence(self.num_timesteps, steps)

    def sample(self, model, shape, sampler="ddpm", steps=None, eta=0.0, noise=None, clip_denoised=True,
               progress=False, seeds=None):
        """Generate a float32 (N, ...) tensor of samples in [-1, 1].

        :param shape: (N, C, H, W) (or any (N, ...)) of the output.
        :param sampler: "ddpm" (ancestral; respaced when steps < T) or "ddim" (Song et al., with ``eta``).
        :param steps: number of sampling steps S (default T); timesteps range(0, T, T // S)[:S].
        :param noise: x_T; default standard normal from MegEngine's global RNG (or from ``seeds``).
        :param seeds: one int per image: image j's x_T and every per-step noise draw come only from
            ``np.random.default_rng(seeds[j])``, so an image does not depend on its batch.
        The model always receives the original timesteps, and is run in eval mode (dropout off).
        """
        self.check_sampling(sampler, steps, eta)
        timesteps = samplers.timestep_subsequence(self.num_timesteps, steps)
        shape = tuple(int(s) for s in shape)
        draw_noise = _noise_source(shape, noise, seeds)
        x = Tensor(noise, dtype="float32") if noise is not None else draw_noise()
        if tuple(x.shape) != shape:
            raise ValueError(f"noise has shape {tuple(x.shape)}, expected {shape}")
        with samplers.eval_mode(model):
            if sampler == "ddpm":
                x = samplers.ddpm_sample(self, model, x, timesteps, clip_denoised, draw_noise, progress)
            else:
                x = samplers.ddim_sample(self, model, x, timesteps, eta, clip_denoised, draw_noise, progress)
        return F.clip(x, -1.0, 1.0)


def _noise_source(shape, noise, seeds):
    """A function drawing one standard-normal tensor of ``shape``: per image from ``seeds`` when given,
    else from MegEngine's global RNG."""
    if seeds is None:
        return lambda: megengine.random.normal(size=shape)
    if noise is not None:
        raise ValueError("pass either noise (x_T) or seeds, not both")
    seeds = [int(s) for s in seeds]
    if len(seeds) != shape[0]:
        raise ValueError(f"got {len(seeds)} seeds for a batch of {shape[0]} images; pass one per image")
    rngs = [np.random.default_rng(s) for s in seeds]
    return lambda: Tensor(np.stack([rng.standard_normal(shape[1:], dtype=np.float32) for rng in rngs]))
