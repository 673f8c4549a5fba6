"""megdiffusion: DDPM training, fast sampling and FID on MegEngine."""

from megdiffusion.compat import (empty_dtr_candidates, keep_fastrun_cache_in_memory, limit_worker_spin,
                                 quiet_megengine_when_imported)

__version__ = "0.1.0"

limit_worker_spin()  # before any module of the package imports MegEngine
empty_dtr_candidates()
keep_fastrun_cache_in_memory()
quiet_megengine_when_imported()

__all__ = ["load", "Model", "LoadError", "UNet", "GaussianDiffusion", "make_beta_schedule"]


def __getattr__(name):
    # Lazy exports: importing the package (e.g. for --help) does not load MegEngine.
    if name in ("load", "Model", "LoadError"):
        from megdiffusion.sampling import model

        return getattr(model, name)
    if name == "UNet":
        from megdiffusion.nn import UNet

        return UNet
    if name in ("GaussianDiffusion", "make_beta_schedule"):
        from megdiffusion import diffusion

        return getattr(diffusion, name)
    raise AttributeError(f"module 'megdiffusion' has no attribute {name!r}")
