"""The names the diffusion code accepts. Imports no MegEngine: the training config offers them as flag choices."""
from megdiffusion.diffusion.solvers import SOLVERS, SPACINGS  # noqa: F401  (SPACINGS: offered here with the rest)

# What the model predicts: the noise, x_0, the mean of x_{t-1}, or v = sqrt(alpha_bar) eps - sqrt(1 - alpha_bar) x_0
# (Salimans & Ho 2022), which keeps x_0 well conditioned where alpha_bar is near 0.
MEAN_TYPES = ("eps", "xstart", "xprev", "v")
# Reverse-process variance: beta_t, the posterior variance, or learned by the model from a second set of output
# channels v: "learned_range" interpolates log beta_t and the clipped log posterior variance with (v + 1) / 2
# (Nichol & Dhariwal), "learned" takes v as the log variance itself.
VAR_TYPES = ("fixedlarge", "fixedsmall", "learned_range", "learned")
LEARNED_VAR_TYPES = ("learned_range", "learned")
# "mse": L_simple, plus the vb term unweighted for a learned variance (improved-diffusion's MSE, i.e. its
# rescale_learned_sigmas=False); "hybrid": L_simple + vb * T / 1000, i.e. L_simple + 0.001 L_vlb (its RESCALED_MSE).
LOSS_TYPES = ("mse", "hybrid")
ANCESTRAL = ("ddpm", "ddim")  # ancestral sampling and DDIM on a respaced chain (``samplers.py``)
SAMPLERS = ANCESTRAL + SOLVERS  # and the ODE / SDE solvers of ``solvers.py``


def check_choice(name, value, choices):
    """ValueError (one line) unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
