"""The likelihood terms of the variational bound (Ho et al. 2020, section 3.3; Nichol & Dhariwal 2021), on MegEngine
tensors, in nats: Gaussian KL, and the discretized Gaussian log-likelihood of 8-bit data scaled to [-1, 1].

improved-diffusion's conventions (its ``losses.py``): the normal CDF is the tanh approximation, not erf; bins are
+-1/255 around each value; the edge bins x < -0.999 and x > 0.999 extend to -inf and +inf; every log is of a value
clamped at 1e-12.
"""
import math

import megengine.functional as F

_LOG_FLOOR = 1e-12


def mean_flat(x):
    """Mean over every axis but the first: (N, ...) -> (N,)."""
    return x.reshape(x.shape[0], -1).mean(axis=1)


def normal_kl(mean1, logvar1, mean2, logvar2):
    """KL(N(mean1, exp(logvar1)) || N(mean2, exp(logvar2))), elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + F.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * F.exp(-logvar2))


def approx_standard_normal_cdf(x):
    """The standard normal CDF by the tanh approximation 0.5 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * (1.0 + F.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def discretized_gaussian_log_likelihood(x, means, log_scales):
    """log P(x) under N(means, exp(log_scales)^2) integrated over x's bin of width 2/255, elementwise; ``x`` holds
    8-bit values scaled to [-1, 1] (the first and last bins reach to -inf and +inf)."""
    centered = x - means
    inv_stdv = F.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = F.log(F.maximum(cdf_plus, _LOG_FLOOR))
    log_one_minus_cdf_min = F.log(F.maximum(1.0 - cdf_min, _LOG_FLOOR))
    log_cdf_delta = F.log(F.maximum(cdf_plus - cdf_min, _LOG_FLOOR))
    return F.where(x < -0.999, log_cdf_plus, F.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))
