"""The UNet options in which published DDPM networks differ, with Ho et al.'s choices as defaults.

Imports no MegEngine: the training config offers these names as flag choices, and builds its ``UNetConfig``.
"""
import dataclasses
from typing import Optional, Tuple

NORM_GROUPS = 32  # GroupNorm groups and eps: TensorFlow's group_norm defaults, which Ho's code uses
NORM_EPS = 1e-6

# The stride-2 downsample convolution's padding: "bottom_right" is TF's "SAME" for even sizes (one row and
# column of zeros at the bottom and right; Ho, pesser, diffusers), "symmetric" one on every side (pytorch-ddpm,
# and every megdiffusion checkpoint written before the option existed).
DOWNSAMPLE_PADDINGS = ("bottom_right", "symmetric")
DOWNSAMPLE_PADDING = "bottom_right"

# The sinusoidal timestep embedding: "ho" is [sin | cos] with frequencies exp(-ln(1e4) i / (half - 1));
# "pytorch_ddpm" interleaves sin and cos, with frequencies exp(-ln(1e4) 2i / dim); "iddpm" (improved-diffusion)
# is [cos | sin] with frequencies exp(-ln(1e4) i / half).
TIME_EMBEDDINGS = ("ho", "pytorch_ddpm", "iddpm")
TIME_EMBEDDING = "ho"

# The class label of "no class": it adds no class embedding, so a class-conditional network trained with some labels
# dropped (``--class_dropout``) predicts unconditionally for it (classifier-free guidance).
NO_CLASS = -1


def attention_heads(channels, num_heads=1, num_head_channels=0):
    """Heads of an attention block over ``channels``: channels / num_head_channels when that is set, else
    num_heads; ValueError when the channels do not split evenly."""
    heads = channels // num_head_channels if num_head_channels else num_heads
    if heads < 1 or channels % heads or (num_head_channels and channels % num_head_channels):
        what = f"num_head_channels={num_head_channels}" if num_head_channels else f"num_heads={num_heads}"
        raise ValueError(f"attention over {channels} channels cannot be split into heads with {what}")
    return heads

@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """Everything a ``nn.UNet`` is built from (the defaults: the paper's CIFAR-10 network), checked when made:
    ValueError (one line) for a UNet that cannot be built for ``image_size``. ``out_channels`` None: the input's."""

    in_channels: int = 3
    model_channels: int = 128
    out_channels: Optional[int] = None
    channel_mult: Tuple[int, ...] = (1, 2, 2, 2)
    num_res_blocks: int = 2
    attention_resolutions: Tuple[int, ...] = (16,)
    dropout: float = 0.1
    image_size: int = 32
    norm_groups: int = NORM_GROUPS
    norm_eps: float = NORM_EPS
    downsample_padding: str = DOWNSAMPLE_PADDING
    time_embedding: str = TIME_EMBEDDING
    use_scale_shift_norm: bool = False
    num_heads: int = 1
    num_head_channels: int = 0
    num_classes: int = 0

    def __post_init__(self):
        object.__setattr__(self, "channel_mult", tuple(self.channel_mult))
        object.__setattr__(self, "attention_resolutions", tuple(self.attention_resolutions))
        if self.downsample_padding not in DOWNSAMPLE_PADDINGS:
            raise ValueError(f"downsample_padding must be one of {', '.join(DOWNSAMPLE_PADDINGS)}, "
                             f"got {self.downsample_padding!r}")
        if self.time_embedding not in TIME_EMBEDDINGS:
            raise ValueError(f"time_embedding must be one of {', '.join(TIME_EMBEDDINGS)}, got {self.time_embedding!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        mults, width, groups = self.channel_mult, self.model_channels, self.norm_groups
        if not mults:
            raise ValueError("channel_mult must list at least one multiplier, e.g. (1, 2, 2, 2)")
        if groups < 1:
            raise ValueError(f"norm_groups must be positive, got {groups}")
        for mult in mults:
            if mult < 1 or (width * mult) % groups:
                raise ValueError(f"model_channels * channel_mult must be positive multiples of norm_groups={groups}; "
                                 f"got model_channels={width}, channel_mult={mults}")
        if not self.use_scale_shift_norm and all(width * mult == groups for mult in mults):
            # The time embedding is added per channel right before a GroupNorm: with one channel per group the
            # normalisation subtracts it again, and a network that never sees t cannot denoise (a scale and shift
            # after the norm reach the output).
            raise ValueError(f"with model_channels * channel_mult == norm_groups={groups} at every level the UNet "
                             "cannot see the timestep; raise model_channels or channel_mult, or lower norm_groups")
        factor = 2 ** (len(mults) - 1)
        if self.image_size < 1 or self.image_size % factor:
            raise ValueError(f"image_size={self.image_size} must be divisible by 2**(len(channel_mult)-1)={factor} "
                             f"for channel_mult={mults}")
        resolutions = [self.image_size // 2 ** i for i in range(len(mults))]
        unused = sorted(set(self.attention_resolutions) - set(resolutions))
        if unused:
            raise ValueError(f"attention_resolutions {unused} never occur: with image_size={self.image_size} and "
                             f"{len(mults)} levels the resolutions are {resolutions}")
        if self.num_heads < 1 or self.num_head_channels < 0:
            raise ValueError(f"num_heads must be >= 1 and num_head_channels >= 0, got {self.num_heads}, "
                             f"{self.num_head_channels}")
        attended = [width * mult for resolution, mult in zip(resolutions, mults)
                    if resolution in self.attention_resolutions] + [width * mults[-1]]  # + the middle block
        for channels in attended:
            attention_heads(channels, self.num_heads, self.num_head_channels)


def check_class_label(class_label, num_classes):
    """ValueError (one line) unless ``class_label`` is None or a class of a model of ``num_classes`` (0:
    unconditional)."""
    if class_label is None:
        return
    if not num_classes:
        raise ValueError(f"class {class_label} asked of an unconditional model (trained without --num_classes)")
    if not 0 <= class_label < num_classes:
        raise ValueError(f"class {class_label} is outside the model's classes 0..{num_classes - 1}")
