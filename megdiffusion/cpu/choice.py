"""Which engine computes the UNet: the CPU engine (this package's numpy and oneDNN code: ``native``'s training steps
and sampling calls, ``conv``'s convolutions, ``flat_update``'s optimizer step) or MegEngine's own kernels (GPUs, or
a CPU with ``MEGDIFFUSION_FAST_CONV=0``).

One switch for the process, ``use_cpu_engine``; its default (auto) is the CPU engine on a machine without CUDA. A
``Trainer`` reads it once, when it is built (``training.engine.make_engine``); a ``Conv2d`` forward and a sampling
call read it when they run.
"""
from megdiffusion import environment
from megdiffusion.compat import cuda_available

ENV_VAR = "MEGDIFFUSION_FAST_CONV"

_setting = environment.read(ENV_VAR, None)  # None: auto
_auto = None  # the auto rule's answer, cached (probing CUDA costs time)


def use_cpu_engine(enabled):
    """Choose the engine from the next step, ``Trainer`` or call on: ``True`` the CPU engine, ``False`` MegEngine's
    kernels, ``None`` auto (the CPU engine unless CUDA is available)."""
    global _setting
    if enabled not in (True, False, None):
        raise ValueError(f"use_cpu_engine expects True, False or None (auto); got {enabled!r}")
    _setting = enabled


def cpu_engine_enabled():
    """Whether the CPU engine computes the UNet (see ``use_cpu_engine``)."""
    global _auto
    if _setting is not None:
        return _setting
    if _auto is None:
        _auto = not cuda_available()
    return _auto
