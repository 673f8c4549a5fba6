"""Gaussian diffusion: beta schedules, the DDPM maths, DDPM and DDIM samplers, and the ODE / SDE solvers.

The names each part accepts are in ``choices`` and ``schedules.SCHEDULES``; neither imports MegEngine.
"""
from megdiffusion.diffusion.schedules import make_beta_schedule

__all__ = ["GaussianDiffusion", "make_beta_schedule"]


def __getattr__(name):
    # Lazy, so that importing the names above does not load MegEngine.
    if name == "GaussianDiffusion":
        from megdiffusion.diffusion.gaussian import GaussianDiffusion

        return GaussianDiffusion
    raise AttributeError(f"module 'megdiffusion.diffusion' has no attribute {name!r}")
