"""Neural-network modules: the DDPM UNet and its layers."""
from megdiffusion.nn.unet import UNet

__all__ = ["UNet"]
