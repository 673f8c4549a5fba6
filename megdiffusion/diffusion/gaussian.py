"""Gaussian diffusion (Ho et al. 2020; Nichol & Dhariwal 2021): forward process, posterior, the model's mean and
variance, training losses, the variational bound in bits per dimension, and the single reverse steps.

Timesteps t are integer indices 0..n-1 into this chain (t = 0 is the first noising step). A chain can be a
respaced subsequence of an original one (``respace``): it keeps the original timestep of each index in
``timestep_map``, and the model always receives that original timestep (times 1000 / original T with
``rescale_timesteps``, improved-diffusion's convention). Tensors are NCHW (or any (N, ...)). The schedule arrays
are float64 numpy, computed once; the ones needed per sample are moved to float32 tensors once, in ``__init__``.
The model is passed to each call, never stored.
"""
import math

import numpy as np
from megdiffusion.progress import progress_bar

import megengine
import megengine.functional as F
from megengine import Tensor

from megdiffusion.diffusion import samplers, solvers
from megdiffusion.diffusion.chain import DiffusionChain
from megdiffusion.diffusion.choices import ANCESTRAL
from megdiffusion.diffusion.sampler_settings import SamplerSettings
from megdiffusion.diffusion.losses import discretized_gaussian_log_likelihood, mean_flat, normal_kl

# Arrays gathered per sample at timestep t (moved to float32 tensors once).
_PER_SAMPLE = (
    "log_betas",
    "alphas_cumprod",
    "alphas_cumprod_prev",
    "alphas_cumprod_next",
    "sqrt_alphas_cumprod",
    "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod",
    "sqrt_recip_alphas_cumprod",
    "sqrt_recipm1_alphas_cumprod",
    "posterior_variance",
    "posterior_log_variance_clipped",
    "posterior_mean_coef1",
    "posterior_mean_coef2",
    "mse_weight",
)
_LN2 = math.log(2.0)


def _as_timesteps(t):
    return t.astype("int32") if isinstance(t, Tensor) else Tensor(np.asarray(t), dtype="int32")


class GaussianDiffusion(DiffusionChain):
    """The forward process q(x_t | x_0) and the reverse-process arithmetic around a model, on MegEngine tensors; the
    options and schedule (its parameters) are ``DiffusionChain``'s."""

    def __init__(self, betas, mean_type="eps", var_type="fixedlarge", loss_type="mse", rescale_timesteps=False,
                 timestep_map=None, original_num_steps=None, min_snr_gamma=0.0):
        super().__init__(betas, mean_type, var_type, loss_type, rescale_timesteps, timestep_map, original_num_steps,
                         min_snr_gamma)
        names = _PER_SAMPLE + (("model_log_variance",) if self.model_log_variance is not None else ())
        self._tensors = {name: Tensor(getattr(self, name).astype(np.float32)) for name in names}
        model_t = self.timestep_map * (1000.0 / self.original_num_steps) if self.rescale_timesteps else None
        self._model_timesteps = (Tensor(model_t.astype(np.float32)) if model_t is not None
                                 else Tensor(self.timestep_map.astype(np.int32)))

    def _extract(self, name, t, ndim):
        """The named array at timesteps t (shape (N,)), shaped (N, 1, ..., 1) to broadcast over ndim dims."""
        return self._tensors[name][t].reshape((-1,) + (1,) * (ndim - 1))

    def model_timesteps(self, t):
        """What the model receives for indices t of this chain: the original timesteps (int32), or with
        ``rescale_timesteps`` original t * 1000 / original T (float32)."""
        return self._model_timesteps[_as_timesteps(t)]

    def run_model(self, model, x_t, t):
        """``model`` at x_t and the timesteps it is to see for indices t (``model_timesteps``)."""
        return model(x_t, self.model_timesteps(t))

    # --- the forward process and its posterior

    def q_sample(self, x0, t, noise):
        """Draw x_t ~ q(x_t | x_0): sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) noise."""
        t = _as_timesteps(t)
        return (self._extract("sqrt_alphas_cumprod", t, x0.ndim) * x0
                + self._extract("sqrt_one_minus_alphas_cumprod", t, x0.ndim) * noise)

    def q_mean_variance(self, x0, t):
        """Mean, variance and log variance of q(x_t | x_0), each shaped like x0."""
        t = _as_timesteps(t)
        mean = self._extract("sqrt_alphas_cumprod", t, x0.ndim) * x0
        variance = F.broadcast_to(1.0 - self._extract("alphas_cumprod", t, x0.ndim), x0.shape)
        log_variance = F.broadcast_to(self._extract("log_one_minus_alphas_cumprod", t, x0.ndim), x0.shape)
        return mean, variance, log_variance

    def _posterior_mean(self, x0, x_t, t):
        return (self._extract("posterior_mean_coef1", t, x_t.ndim) * x0
                + self._extract("posterior_mean_coef2", t, x_t.ndim) * x_t)

    def q_posterior_mean_variance(self, x0, x_t, t):
        """Mean, variance and clipped log variance of q(x_{t-1} | x_t, x_0), each shaped like x_t."""
        t = _as_timesteps(t)
        mean = self._posterior_mean(x0, x_t, t)
        variance = F.broadcast_to(self._extract("posterior_variance", t, x_t.ndim), x_t.shape)
        log_variance = F.broadcast_to(self._extract("posterior_log_variance_clipped", t, x_t.ndim), x_t.shape)
        return mean, variance, log_variance

    # --- the model's predictions

    def predict_xstart_from_eps(self, x_t, t, eps):
        """x_0 = (x_t - sqrt(1 - alpha_bar_t) eps) / sqrt(alpha_bar_t)."""
        return (self._extract("sqrt_recip_alphas_cumprod", t, x_t.ndim) * x_t
                - self._extract("sqrt_recipm1_alphas_cumprod", t, x_t.ndim) * eps)

    def predict_eps_from_xstart(self, x_t, t, x0):
        """The eps that, with x_t, gives x0 (the inverse of ``predict_xstart_from_eps``)."""
        return ((self._extract("sqrt_recip_alphas_cumprod", t, x_t.ndim) * x_t - x0)
                / self._extract("sqrt_recipm1_alphas_cumprod", t, x_t.ndim))

    def predict_xstart_from_v(self, x_t, t, v):
        """x_0 = sqrt(alpha_bar_t) x_t - sqrt(1 - alpha_bar_t) v."""
        return (self._extract("sqrt_alphas_cumprod", t, x_t.ndim) * x_t
                - self._extract("sqrt_one_minus_alphas_cumprod", t, x_t.ndim) * v)

    def v_target(self, x0, t, noise):
        """v = sqrt(alpha_bar_t) noise - sqrt(1 - alpha_bar_t) x_0, the target of a v model."""
        return (self._extract("sqrt_alphas_cumprod", t, x0.ndim) * noise
                - self._extract("sqrt_one_minus_alphas_cumprod", t, x0.ndim) * x0)

    def predict_xstart_from_xprev(self, x_t, t, xprev):
        """The x_0 whose posterior mean, with x_t, is xprev."""
        return ((xprev - self._extract("posterior_mean_coef2", t, x_t.ndim) * x_t)
                / self._extract("posterior_mean_coef1", t, x_t.ndim))

    def split_output(self, output):
        """(the mean-type prediction, the variance values v or None): a learned variance's model outputs twice
        the image channels, the prediction first."""
        if not self.learns_variance:
            return output, None
        if output.shape[1] % 2:
            raise ValueError(f"a learned variance needs an even number of output channels, got {output.shape[1]}")
        prediction, values = F.split(output, 2, axis=1)
        return prediction, values

    def p_mean_variance(self, output, x_t, t, clip_denoised=True):
        """The reverse step p(x_{t-1} | x_t) the model ``output`` at (x_t, t) describes: a dict of ``mean``,
        ``variance``, ``log_variance`` (each shaped like x_t), ``pred_xstart`` (clipped to [-1, 1] with
        ``clip_denoised``) and ``eps`` (the noise that pred_xstart and x_t imply; the output itself for an
        eps model without clipping). The mean is the posterior mean of pred_xstart and x_t."""
        t = _as_timesteps(t)
        prediction, values = self.split_output(output)
        if self.var_type == "learned":
            log_variance = values
        elif self.var_type == "learned_range":
            frac = (values + 1.0) / 2.0
            log_variance = (frac * self._extract("log_betas", t, x_t.ndim)
                            + (1.0 - frac) * self._extract("posterior_log_variance_clipped", t, x_t.ndim))
        else:
            log_variance = F.broadcast_to(self._extract("model_log_variance", t, x_t.ndim), x_t.shape)
        if self.mean_type == "eps":
            x0 = self.predict_xstart_from_eps(x_t, t, prediction)
        elif self.mean_type == "xstart":
            x0 = prediction
        elif self.mean_type == "v":
            x0 = self.predict_xstart_from_v(x_t, t, prediction)
        else:
            x0 = self.predict_xstart_from_xprev(x_t, t, prediction)
        if clip_denoised:
            x0 = F.clip(x0, -1.0, 1.0)
        eps = prediction if self.mean_type == "eps" and not clip_denoised else self.predict_eps_from_xstart(x_t, t, x0)
        return {"mean": self._posterior_mean(x0, x_t, t), "variance": F.exp(log_variance),
                "log_variance": log_variance, "pred_xstart": x0, "eps": eps}

    # --- training

    def _draw_timesteps(self, n):
        """n timestep indices drawn uniformly from 0..num_timesteps-1 with MegEngine's global RNG."""
        return F.minimum(F.floor(megengine.random.uniform(0, self.num_timesteps, size=(n,))), self.num_timesteps - 1)

    def training_losses(self, model, x0, t=None, noise=None, perturbation=None):
        """Per-sample losses (each shape (N,)) at x_t ~ q(x_t | x_0): ``mse`` between the model's prediction and
        its target (the noise, x_0 or the posterior mean, by mean type), with a learned variance ``vb``, the
        variational-bound term in bits with the prediction behind a stop-gradient (so it trains only the
        variance; times T / 1000 for "hybrid"), and ``loss`` = mse (+ vb). t defaults to uniform draws and noise
        to standard normal, both from MegEngine's global RNG. ``perturbation`` (input perturbation, Ning et al.
        2023): added to the noise that makes x_t, not to the target's."""
        t = _as_timesteps(self._draw_timesteps(x0.shape[0]) if t is None else t)
        if noise is None:
            noise = megengine.random.normal(size=x0.shape)
        x_t = self.training_inputs(x0, t, noise, perturbation)
        return self.losses_of_output(self.run_model(model, x_t, t), x0, x_t, t, noise)

    def training_inputs(self, x0, t, noise, perturbation=None):
        """x_t of ``training_losses``: q(x_t | x_0) with ``noise`` (plus ``perturbation``, which the target lacks)."""
        return self.q_sample(x0, _as_timesteps(t), noise if perturbation is None else noise + perturbation)

    def losses_of_output(self, output, x0, x_t, t, noise):
        """``training_losses``' terms given the network's ``output`` at (x_t, t): the half after the network, so that
        an engine computing the network elsewhere (the CPU engine) takes its loss and d loss / d output from here."""
        t = _as_timesteps(t)
        prediction, values = self.split_output(output)
        if self.mean_type == "eps":
            target = noise
        elif self.mean_type == "xstart":
            target = x0
        elif self.mean_type == "v":
            target = self.v_target(x0, t, noise)
        else:
            target = self._posterior_mean(x0, x_t, t)
        terms = {"mse": mean_flat((prediction - target) ** 2)}
        terms["loss"] = terms["mse"]
        if self.min_snr_gamma > 0:  # weights of 1 otherwise: no multiplication on the training path
            terms["loss"] = terms["mse"] * self._extract("mse_weight", t, 1)
        if values is not None:
            frozen = F.concat([prediction.detach(), values], axis=1)
            terms["vb"] = self.vb_terms_bpd(frozen, x0, x_t, t, clip_denoised=False)["output"]
            if self.loss_type == "hybrid":
                terms["vb"] = terms["vb"] * (self.num_timesteps / 1000.0)
            terms["loss"] = terms["loss"] + terms["vb"]
        return terms

    # --- the variational bound, in bits per dimension

    def vb_terms_bpd(self, output, x0, x_t, t, clip_denoised=True):
        """One term of the variational bound per sample, in bits per dimension, for the model ``output`` at
        (x_t, t): ``kl`` = KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) (with the posterior's clipped log
        variance), ``decoder_nll`` = -log p(x_0 | x_1) (discretized Gaussian), both for every row, and
        ``output``: the decoder NLL where t == 0, the KL elsewhere. Also ``pred_xstart``."""
        t = _as_timesteps(t)
        true_mean, _, true_log_variance = self.q_posterior_mean_variance(x0, x_t, t)
        p = self.p_mean_variance(output, x_t, t, clip_denoised)
        kl = mean_flat(normal_kl(true_mean, true_log_variance, p["mean"], p["log_variance"])) / _LN2
        decoder_nll = -mean_flat(discretized_gaussian_log_likelihood(x0, p["mean"], 0.5 * p["log_variance"])) / _LN2
        return {"output": F.where(t == 0, decoder_nll, kl), "kl": kl, "decoder_nll": decoder_nll,
                "pred_xstart": p["pred_xstart"]}

    def prior_bpd(self, x0):
        """KL(q(x_{n-1} | x_0) || N(0, I)) per sample in bits per dimension: the prior term, ~0 for a good chain."""
        mean, _, log_variance = self.q_mean_variance(x0, np.full(x0.shape[0], self.num_timesteps - 1))
        zeros = F.zeros_like(mean)
        return mean_flat(normal_kl(mean, log_variance, zeros, zeros)) / _LN2

    def calc_bpd_loop(self, model, x0, clip_denoised=True, draw_noise=None, progress=None):
        """The whole variational bound of each image of x0 (uint8 values scaled to [-1, 1]), in bits per dimension.

        Walks t = n-1 .. 0, drawing fresh noise for each t (``draw_noise()``; default standard normal from
        MegEngine's global RNG) and running the model in eval mode; ``progress``, a tqdm bar, advances by
        N / n per timestep. Returns float64 numpy arrays: ``total_bpd`` and ``prior_bpd`` (N,), and (N, n) ``vb``,
        ``xstart_mse`` and ``mse`` (eps re-derived from the clipped x_0 prediction), column t for timestep t.
        total_bpd = sum of vb over t + prior_bpd.
        """
        n = x0.shape[0]
        draw_noise = draw_noise or (lambda: megengine.random.normal(size=x0.shape))
        columns = {name: np.zeros((n, self.num_timesteps)) for name in ("vb", "xstart_mse", "mse")}
        with samplers.eval_mode(model):
            for t in range(self.num_timesteps - 1, -1, -1):
                t_batch = F.full((n,), t, dtype="int32")
                noise = draw_noise()
                x_t = self.q_sample(x0, t_batch, noise)
                terms = self.vb_terms_bpd(self.run_model(model, x_t, t_batch), x0, x_t, t_batch, clip_denoised)
                eps = self.predict_eps_from_xstart(x_t, t_batch, terms["pred_xstart"])
                columns["vb"][:, t] = terms["output"].numpy()
                columns["xstart_mse"][:, t] = mean_flat((terms["pred_xstart"] - x0) ** 2).numpy()
                columns["mse"][:, t] = mean_flat((eps - noise) ** 2).numpy()
                if progress is not None:
                    progress.update(n / self.num_timesteps)
        prior = self.prior_bpd(x0).numpy().astype(np.float64)
        return {"total_bpd": columns["vb"].sum(axis=1) + prior, "prior_bpd": prior, **columns}

    # --- reverse steps and sampling

    def p_sample_step(self, model, x_t, t, clip_denoised=True, noise=None):
        """One ancestral step: (x_{t-1}, pred_xstart), x_{t-1} = mean + exp(log variance / 2) * noise, with no
        noise where t == 0 (and none at all when ``noise`` is None)."""
        t = _as_timesteps(t)
        p = self.p_mean_variance(self.run_model(model, x_t, t), x_t, t, clip_denoised)
        sample = p["mean"]
        if noise is not None:
            nonzero = (t != 0).astype("float32").reshape((-1,) + (1,) * (x_t.ndim - 1))
            sample = sample + nonzero * F.exp(0.5 * p["log_variance"]) * noise
        return sample, p["pred_xstart"]

    def ddim_step(self, model, x_t, t, eta=0.0, clip_denoised=True, noise=None):
        """One DDIM step (Song et al. 2021, eq. 12) from index t to t - 1 of this chain: (x_prev, pred_xstart),
        x_prev = sqrt(a_prev) x_0 + sqrt(1 - a_prev - sigma^2) eps + sigma noise, sigma = eta sqrt((1 - a_prev)
        / (1 - a)) sqrt(1 - a / a_prev) (eq. 16), a = alpha_bar at t, a_prev at t - 1 (1 after t = 0); eps is
        re-derived from the (clipped) x_0 prediction. No noise term when ``noise`` is None."""
        t = _as_timesteps(t)
        p = self.p_mean_variance(self.run_model(model, x_t, t), x_t, t, clip_denoised)
        a, a_prev = self._extract("alphas_cumprod", t, x_t.ndim), self._extract("alphas_cumprod_prev", t, x_t.ndim)
        sigma = eta * F.sqrt((1.0 - a_prev) / (1.0 - a)) * F.sqrt(1.0 - a / a_prev)
        sample = F.sqrt(a_prev) * p["pred_xstart"] + F.sqrt(F.maximum(1.0 - a_prev - sigma ** 2, 0.0)) * p["eps"]
        if noise is not None:
            sample = sample + sigma * noise
        return sample, p["pred_xstart"]

    def ddim_reverse_step(self, model, x_t, t, clip_denoised=True):
        """One deterministic DDIM step forward in time, from index t to t + 1 (DDIM inversion: encoding an image
        into the chain's noise): pred_xstart sqrt(a_next) + sqrt(1 - a_next) eps, with a_next = alpha_bar at
        t + 1 (0 past the end)."""
        t = _as_timesteps(t)
        p = self.p_mean_variance(self.run_model(model, x_t, t), x_t, t, clip_denoised)
        a_next = self._extract("alphas_cumprod_next", t, x_t.ndim)
        return F.sqrt(a_next) * p["pred_xstart"] + F.sqrt(1.0 - a_next) * p["eps"]

    def sample(self, model, shape, sampler="ddpm", steps=None, eta=0.0, noise=None, clip_denoised=True,
               progress=False, seeds=None, respacing=None, spacing=None, order=None):
        """Generate a float32 (N, ...) tensor of samples in [-1, 1].

        :param shape: (N, C, H, W) (or any (N, ...)) of the output.
        :param sampler: "ddpm" (ancestral) or "ddim" (Song et al., with ``eta``), both on the chain respaced to
            the kept timesteps (``respaced``), learned variances included; or an ODE / SDE solver of
            ``solvers.SOLVERS`` (``solve``), which uses the model's x_0 prediction only.
        :param steps: number of sampling steps S (default T; a solver's ``solvers.DEFAULT_STEPS``).
        :param respacing: ddpm and ddim, instead of ``steps``: improved-diffusion's spacing ("50", "10,15,20",
            "ddim50").
        :param spacing: where the S steps lie (``solvers.SPACINGS``; ddpm and ddim: leading, the default, linspace
            or trailing; a solver's default ``solvers.DEFAULT_SPACING``).
        :param order: a multistep solver's order (``solvers.ORDERS``).
        :param noise: x_T; default standard normal from MegEngine's global RNG (or from ``seeds``).
        :param seeds: one int per image: image j's x_T and every per-step noise draw come only from
            ``np.random.default_rng(seeds[j])``, so an image does not depend on its batch.
        :param clip_denoised: clip every x_0 prediction to [-1, 1].
        The model always receives the original timesteps, and is run in eval mode (dropout off).
        """
        SamplerSettings(sampler, steps, eta, respacing, spacing, order).check(self)
        shape = tuple(int(s) for s in shape)
        draw_noise = noise_source(shape, noise, seeds)
        x = Tensor(noise, dtype="float32") if noise is not None else draw_noise()
        if tuple(x.shape) != shape:
            raise ValueError(f"noise has shape {tuple(x.shape)}, expected {shape}")
        with samplers.eval_mode(model):
            if sampler in ANCESTRAL:
                chain = self.respaced(steps, respacing, spacing)
                if sampler == "ddpm":
                    x = samplers.ddpm_sample(chain, model, x, clip_denoised, draw_noise, progress)
                else:
                    x = samplers.ddim_sample(chain, model, x, eta, clip_denoised, draw_noise, progress)
            else:
                x = self.solve(model, x, sampler, *solvers.with_defaults(steps, spacing), order, clip_denoised,
                               draw_noise, progress)
        return F.clip(x, -1.0, 1.0)

    def solve(self, model, x, sampler, steps, spacing, order=None, clip_denoised=True, draw_noise=None,
              progress=False, lambda_min_clipped=-np.inf, lower_order_final=True):
        """Run solver ``sampler`` (``solvers.solve``) from x = x_T (this chain's last noise level on every grid
        but ``leading``'s, whose first step starts lower, as DDIM's) on the ``solvers.make_grid`` grid; returns the
        final x_0 estimate, unclipped. The model sees x_t = y sqrt(alpha_bar) with alpha_bar = 1 / (1 + sigma^2) of
        the solver's sigma, and the (fractional) timestep there, interpolated between the model's timesteps.
        ``lambda_min_clipped``, ``lower_order_final``: diffusers' options of the same names (``solvers``)."""
        grid = solvers.make_grid(self.alphas_cumprod, steps, spacing, sampler, lambda_min_clipped)
        model_times = np.interp(grid.timesteps, np.arange(self.num_timesteps),
                                self.model_timesteps(np.arange(self.num_timesteps)).numpy().astype(np.float64))
        bar = progress_bar(total=solvers.calls_per_image(sampler, steps), disable=not progress, leave=False,
                           unit="call")

        def denoise(i, y):
            abar = 1.0 / (1.0 + grid.sigmas[i] ** 2)
            x_t = y * float(math.sqrt(abar))
            output = model(x_t, Tensor(np.full(x_t.shape[0], model_times[i], np.float32)))
            prediction, _ = self.split_output(output)
            if self.mean_type == "eps":
                x0 = (x_t - prediction * float(math.sqrt(1.0 - abar))) * float(1.0 / math.sqrt(abar))
            elif self.mean_type == "v":
                x0 = x_t * float(math.sqrt(abar)) - prediction * float(math.sqrt(1.0 - abar))
            else:
                x0 = prediction
            return F.clip(x0, -1.0, 1.0) if clip_denoised else x0

        with bar:
            y = x * float(math.sqrt(1.0 + grid.sigmas[0] ** 2))
            return solvers.solve(sampler, y, grid.sigmas, denoise, order, draw_noise, bar, lower_order_final)


def noise_source(shape, noise=None, seeds=None):
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
