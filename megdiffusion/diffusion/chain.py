"""The chain of a Gaussian diffusion: its options checked and the schedule's coefficients as float64 arrays, without
MegEngine (what a config's validation and the CPU engine read); ``GaussianDiffusion`` adds the arithmetic on tensors."""
import numpy as np

from megdiffusion.diffusion import solvers
from megdiffusion.diffusion.choices import LEARNED_VAR_TYPES, LOSS_TYPES, MEAN_TYPES, VAR_TYPES, check_choice
from megdiffusion.diffusion.spacing import sampling_timesteps


class DiffusionChain:
    """A diffusion's options and its schedule's coefficients (float64 numpy arrays, one per timestep).

    :param betas: 1-D float array of the forward-process variances, each in (0, 1).
    :param mean_type: "eps" (the paper's choice), "xstart", "xprev" or "v": what ``model(x_t, t)`` predicts; v is
        sqrt(alpha_bar_t) eps - sqrt(1 - alpha_bar_t) x_0 (Salimans & Ho 2022), so x_0 = sqrt(alpha_bar_t) x_t -
        sqrt(1 - alpha_bar_t) v: unlike x_0 from eps, an error in v is not amplified by 1 / sqrt(alpha_bar_t) at
        the noisiest steps.
    :param var_type: "fixedlarge" (beta_t, with the posterior variance at t = 0, the official CIFAR-10
        choice), "fixedsmall" (the posterior variance, clipped at t = 0), or learned from the model's second
        half of output channels v: "learned_range" (log variance frac log beta_t + (1 - frac) log posterior
        variance (clipped), frac = (v + 1) / 2, v unclamped) or "learned" (v is the log variance).
    :param loss_type: "mse" or "hybrid" (``choices.LOSS_TYPES``); "hybrid" needs a learned variance.
    :param rescale_timesteps: the model receives t * 1000 / original T (a float) instead of t.
    :param min_snr_gamma: 0 for Ho's L_simple; above 0, the mse of timestep t weighted by min(SNR_t, gamma) / SNR_t
        for eps prediction, min(SNR_t, gamma) for x_0 and min(SNR_t, gamma) / (SNR_t + 1) for v (Hang et al. 2023,
        "Min-SNR"; SNR_t = alpha_bar_t / (1 - alpha_bar_t)): the low-noise steps, whose loss is easy and large in
        number, no longer dominate the gradient.
    :param timestep_map: the original timestep of each index (default: the identity); ``respace`` sets it.
    :param original_num_steps: T of the original chain (default: len(betas)).
    """

    def __init__(self, betas, mean_type="eps", var_type="fixedlarge", loss_type="mse", rescale_timesteps=False,
                 timestep_map=None, original_num_steps=None, min_snr_gamma=0.0):
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or len(betas) < 1:
            raise ValueError(f"betas must be a non-empty 1-D array, got shape {betas.shape}")
        if not ((betas > 0) & (betas < 1)).all():
            raise ValueError("betas must all lie strictly between 0 and 1")
        check_choice("mean_type", mean_type, MEAN_TYPES)
        check_choice("var_type", var_type, VAR_TYPES)
        check_choice("loss_type", loss_type, LOSS_TYPES)
        if loss_type == "hybrid" and var_type not in LEARNED_VAR_TYPES:
            raise ValueError(f"loss_type 'hybrid' weights the vb term that trains a learned variance; var_type "
                             f"{var_type!r} learns none (use {' or '.join(LEARNED_VAR_TYPES)}, or loss_type 'mse')")
        if min_snr_gamma < 0 or (min_snr_gamma > 0 and mean_type == "xprev"):
            raise ValueError(f"min_snr_gamma must be 0 (off) or positive with mean_type eps, xstart or v; got "
                             f"{min_snr_gamma} with mean_type {mean_type!r}")
        self.mean_type, self.var_type, self.loss_type = mean_type, var_type, loss_type
        self.min_snr_gamma = float(min_snr_gamma)
        self.rescale_timesteps = bool(rescale_timesteps)
        self.num_timesteps = len(betas)
        self.timestep_map = np.arange(len(betas)) if timestep_map is None else np.asarray(timestep_map, np.int64)
        self.original_num_steps = len(betas) if original_num_steps is None else int(original_num_steps)
        if self.timestep_map.shape != betas.shape:
            raise ValueError(f"timestep_map has shape {self.timestep_map.shape}, betas {betas.shape}")

        self.betas = betas
        self.log_betas = np.log(betas)
        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.alphas_cumprod_next = np.append(self.alphas_cumprod[1:], 0.0)
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.log_one_minus_alphas_cumprod = np.log(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1.0)
        # q(x_{t-1} | x_t, x_0) = N(coef1 * x_0 + coef2 * x_t, posterior_variance)   (paper eq. 6-7)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # The variance is 0 at t = 0: its log is clipped to the value at t = 1 (a one-step chain, which has no
        # t = 1, takes log beta_0; only the decoder term and learned_range read it there).
        self.posterior_log_variance_clipped = np.log(
            np.append(self.posterior_variance[1], self.posterior_variance[1:]) if len(betas) > 1 else betas
        )
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (
            (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)
        )
        if var_type == "fixedlarge":
            # Ho's code: beta_t, except posterior_variance[1] at t = 0 (a better decoder variance there).
            self.model_log_variance = np.append(self.posterior_log_variance_clipped[0], self.log_betas[1:])
        elif var_type == "fixedsmall":
            self.model_log_variance = self.posterior_log_variance_clipped
        else:
            self.model_log_variance = None  # the model's output says

        # The weight of each timestep's mse in the loss: 1 (L_simple), or Min-SNR's.
        snr = self.alphas_cumprod / (1.0 - self.alphas_cumprod)
        clipped = np.minimum(snr, self.min_snr_gamma)
        per_x0_mse = {"eps": snr, "xstart": np.ones_like(snr), "v": snr + 1.0}.get(mean_type)  # mse / x_0's mse
        self.mse_weight = np.ones_like(snr) if self.min_snr_gamma == 0 else clipped / per_x0_mse

    @property
    def learns_variance(self):
        """Whether the model outputs a variance (twice the image channels)."""
        return self.var_type in LEARNED_VAR_TYPES

    def respace(self, timesteps):
        """The chain over the increasing subsequence ``timesteps`` of this one: betas recomputed so that its
        alphas_cumprod are this chain's alphas_cumprod at those timesteps; the model still sees the original
        timesteps (``timestep_map``)."""
        timesteps = np.asarray(timesteps, dtype=np.int64)
        if timesteps.ndim != 1 or not len(timesteps) or (np.diff(timesteps) <= 0).any() \
                or timesteps[0] < 0 or timesteps[-1] >= self.num_timesteps:
            raise ValueError(f"respacing needs increasing timesteps within 0..{self.num_timesteps - 1}")
        alphas_cumprod = self.alphas_cumprod[timesteps]
        betas = 1.0 - alphas_cumprod / np.append(1.0, alphas_cumprod[:-1])
        return type(self)(betas, self.mean_type, self.var_type, self.loss_type, self.rescale_timesteps,
                          self.timestep_map[timesteps], self.original_num_steps, self.min_snr_gamma)

    def respaced(self, steps=None, respacing=None, spacing=None):
        """This chain respaced to the timesteps ``spacing.sampling_timesteps`` keeps, or with ``spacing``
        "linspace" or "trailing" those of ``solvers.integer_timesteps`` (itself when all are kept)."""
        if spacing in ("linspace", "trailing"):
            steps = self.num_timesteps if steps is None else steps
            timesteps = np.sort(solvers.integer_timesteps(self.num_timesteps, steps, spacing, drop_zero=False))
        else:
            timesteps = sampling_timesteps(self.num_timesteps, steps, respacing)
        return self if len(timesteps) == self.num_timesteps else self.respace(timesteps)
