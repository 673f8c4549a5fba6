"""Neural-network modules: the DDPM UNet and its layers (``options`` names the UNet's options without MegEngine)."""

__all__ = ["UNet"]


def __getattr__(name):
    # Lazy, so that importing ``megdiffusion.nn.options`` does not load MegEngine.
    if name == "UNet":
        from megdiffusion.nn.unet import UNet

        return UNet
    raise AttributeError(f"module 'megdiffusion.nn' has no attribute {name!r}")
