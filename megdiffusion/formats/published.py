"""The published networks: recognised by their family and shape, with what their files do not record."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    """A published network, recognised by its family and shape, and what its file does not record."""

    name: str
    family: str  # "ddpm": Ho et al.'s network (every format but improved_diffusion), or "improved_diffusion"
    image_size: int
    model_channels: int
    channel_mult: tuple
    num_res_blocks: int
    attention_levels: tuple
    var_type: str
    dropout: float
    settings: tuple = ()  # further (TrainConfig field, value) pairs


# Ho et al. 2020: linear betas 1e-4..0.02, T = 1000, eps prediction for all; fixedlarge for CIFAR-10's FID.
# improved-diffusion: the flags of its README (4 heads and attention at 16 and 8 pixels by default); its L_vlb
# models (``*_vlb_*``) have the same networks, trained with a loss megdiffusion does not have (hybrid is recorded).
_IDDPM_4000 = (("num_timesteps", 4000), ("beta_schedule", "cosine"), ("num_heads", 4), ("rescale_timesteps", True),
               ("loss_type", "hybrid"))
PUBLISHED = (
    Published("Ho et al.'s CIFAR-10 model", "ddpm", 32, 128, (1, 2, 2, 2), 2, (1,), "fixedlarge", 0.1),
    Published("Ho et al.'s 256x256 models (CelebA-HQ, LSUN bedroom, cat, church)", "ddpm", 256, 128,
              (1, 1, 2, 2, 4, 4), 2, (4,), "fixedsmall", 0.0),
    Published("improved-diffusion's CIFAR-10 models (cifar10_uncond_50M_500K, cifar10_uncond_vlb_50M_500K)",
              "improved_diffusion", 32, 128, (1, 2, 2, 2), 3, (1, 2), "learned_range", 0.3, _IDDPM_4000),
    Published("improved-diffusion's ImageNet-64 models (imagenet64_uncond_100M_1500K, "
              "imagenet64_uncond_vlb_100M_1500K)",
              "improved_diffusion", 64, 128, (1, 2, 3, 4), 3, (1, 2), "learned_range", 0.0, _IDDPM_4000),
    Published("improved-diffusion's LSUN bedroom models (lsun_uncond_100M_1200K_bs128, lsun_uncond_100M_2400K_bs64)",
              "improved_diffusion", 256, 128, (1, 1, 2, 2, 4, 4), 2, (4,), "learned_range", 0.0,
              (("num_timesteps", 1000), ("beta_schedule", "linear"), ("num_heads", 1), ("rescale_timesteps", False),
               ("loss_type", "mse"))),
)

# The MegEngine port's hub files (its megdiffusion/model/pretrain/ddpm.py): its own CIFAR-10 models take BGR
# images, the ones converted from Ho's checkpoints RGB. Other files of that format need --channel_order.
PORT_CHANNEL_ORDERS = {
    "ddpm_cifar10.pkl": "bgr", "ddpm_cifar10_ema.pkl": "bgr",
    **{f"ddpm_{name}{ema}_converted.pkl": "rgb" for name in ("cifar10", "lsun_bedroom", "lsun_cat", "lsun_church",
                                                             "celebahq_256") for ema in ("", "_ema")},
}


def family_of(fmt):
    """The network family (``Published.family``) of a format: improved-diffusion's, or Ho et al.'s."""
    return "improved_diffusion" if fmt == "improved_diffusion" else "ddpm"


def find_published(family, fields):
    """The published network of ``family`` whose shape ``fields`` describe, or None."""
    shape = tuple(fields[k] for k in ("model_channels", "channel_mult", "num_res_blocks", "attention_levels"))
    return next((p for p in PUBLISHED if p.family == family
                 and (p.model_channels, p.channel_mult, p.num_res_blocks, p.attention_levels) == shape), None)
