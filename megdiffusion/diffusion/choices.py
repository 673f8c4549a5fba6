"""The names the diffusion code accepts. Imports no MegEngine: the training config offers them as flag choices."""

MEAN_TYPES = ("eps", "xstart", "xprev")  # what the model predicts: the noise, x_0 or the mean of x_{t-1}
VAR_TYPES = ("fixedlarge", "fixedsmall")  # sampling variance: beta_t or the posterior variance
SAMPLERS = ("ddpm", "ddim")  # ancestral sampling and DDIM (``samplers.py``)
