"""Conv2d used by every convolution of the UNet.

TEMPORARY: plain MegEngine convolution. Issue 7 replaces this with a layer whose CPU backward computes
the weight gradient by a fast route; the class name, signature and parameters stay the same.
"""
import megengine.module as M


class Conv2d(M.Conv2d):
    """Drop-in ``megengine.module.Conv2d`` (same parameters and checkpoint format)."""
