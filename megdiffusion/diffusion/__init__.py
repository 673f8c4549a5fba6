"""Gaussian diffusion: beta schedules, the DDPM maths, DDPM and DDIM samplers."""
from megdiffusion.diffusion.gaussian import MEAN_TYPES, SAMPLERS, VAR_TYPES, GaussianDiffusion
from megdiffusion.diffusion.schedules import SCHEDULES, make_beta_schedule

__all__ = ["GaussianDiffusion", "make_beta_schedule", "MEAN_TYPES", "VAR_TYPES", "SAMPLERS", "SCHEDULES"]
