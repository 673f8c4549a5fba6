"""The DDPM UNet of Ho et al. 2020 (``diffusion_tf/models/unet.py``), on MegEngine, with the options of
improved-diffusion's UNet (Nichol & Dhariwal 2021): scale-shift norm, multi-head attention, its time embedding,
and twice the output channels for a learned variance.

Parameter names follow Ho's scopes: ``down.<level>.blocks.<i>``, ``down.<level>.attns.<i>``,
``down.<level>.downsample``, ``mid_block1``/``mid_attn``/``mid_block2``, ``up.<level>...`` (level 0 is the
full resolution, as in Ho's ``down_0``/``up_0``), ``conv_in``, ``norm_out``, ``conv_out``; a class-conditional
network adds ``class_emb`` (improved-diffusion's ``label_emb``).
The paper's CIFAR-10 config (the defaults) has 35,746,307 parameters.
"""
import functools

import megengine.functional as F
import megengine.module as M

from megdiffusion.nn.layers import (
    AttnBlock,
    Downsample,
    ResBlock,
    Upsample,
    conv2d,
    group_norm,
    linear,
    silu,
    timestep_embedding,
)
from megdiffusion.nn.options import DOWNSAMPLE_PADDING, DOWNSAMPLE_PADDINGS, NO_CLASS, NORM_EPS, NORM_GROUPS, \
    TIME_EMBEDDING, TIME_EMBEDDINGS


class DownLevel(M.Module):
    """One resolution on the way down: residual blocks, each followed by attention when ``attns`` is
    non-empty, then an optional Downsample. ``forward`` returns every output the up path will use."""

    def __init__(self, blocks, attns, downsample):
        super().__init__()
        self.blocks = blocks
        self.attns = attns
        self.downsample = downsample

    def forward(self, h, temb):
        outputs = []
        for i, block in enumerate(self.blocks):
            h = block(h, temb)
            if self.attns:
                h = self.attns[i](h)
            outputs.append(h)
        if self.downsample is not None:
            outputs.append(self.downsample(h))
        return outputs


class UpLevel(M.Module):
    """One resolution on the way up: residual blocks on [h, skip] concatenations (skips popped from the
    end of ``skips``), each followed by attention when ``attns`` is non-empty, then an optional Upsample."""

    def __init__(self, blocks, attns, upsample):
        super().__init__()
        self.blocks = blocks
        self.attns = attns
        self.upsample = upsample

    def forward(self, h, temb, skips):
        for i, block in enumerate(self.blocks):
            h = block(F.concat([h, skips.pop()], axis=1), temb)
            if self.attns:
                h = self.attns[i](h)
        if self.upsample is not None:
            h = self.upsample(h)
        return h


def attention_heads(channels, num_heads=1, num_head_channels=0):
    """Heads of an attention block over ``channels``: channels / num_head_channels when that is set, else
    num_heads; ValueError when the channels do not split evenly."""
    heads = channels // num_head_channels if num_head_channels else num_heads
    if heads < 1 or channels % heads or (num_head_channels and channels % num_head_channels):
        what = f"num_head_channels={num_head_channels}" if num_head_channels else f"num_heads={num_heads}"
        raise ValueError(f"attention over {channels} channels cannot be split into heads with {what}")
    return heads


def check_config(model_channels, channel_mult, attention_resolutions, image_size, norm_groups=NORM_GROUPS,
                 norm_eps=NORM_EPS, downsample_padding=DOWNSAMPLE_PADDING, time_embedding=TIME_EMBEDDING, num_heads=1,
                 num_head_channels=0, use_scale_shift_norm=False):
    """Raise ValueError (one line) for a UNet that cannot be built for ``image_size``."""
    if downsample_padding not in DOWNSAMPLE_PADDINGS:
        raise ValueError(f"downsample_padding must be one of {', '.join(DOWNSAMPLE_PADDINGS)}, "
                         f"got {downsample_padding!r}")
    if time_embedding not in TIME_EMBEDDINGS:
        raise ValueError(f"time_embedding must be one of {', '.join(TIME_EMBEDDINGS)}, got {time_embedding!r}")
    if not norm_eps > 0:
        raise ValueError(f"norm_eps must be positive, got {norm_eps}")
    if not channel_mult:
        raise ValueError("channel_mult must list at least one multiplier, e.g. (1, 2, 2, 2)")
    if norm_groups < 1:
        raise ValueError(f"norm_groups must be positive, got {norm_groups}")
    for mult in channel_mult:
        if mult < 1 or (model_channels * mult) % norm_groups:
            raise ValueError(
                f"model_channels * channel_mult must be positive multiples of norm_groups={norm_groups}; "
                f"got model_channels={model_channels}, channel_mult={tuple(channel_mult)}"
            )
    if not use_scale_shift_norm and all(model_channels * mult == norm_groups for mult in channel_mult):
        # The time embedding is added per channel right before a GroupNorm: with one channel per group
        # the normalisation subtracts it again, and a network that never sees t cannot denoise (a scale and
        # shift after the norm reach the output).
        raise ValueError(
            f"with model_channels * channel_mult == norm_groups={norm_groups} at every level the UNet "
            "cannot see the timestep; raise model_channels or channel_mult, or lower norm_groups"
        )
    factor = 2 ** (len(channel_mult) - 1)
    if image_size < 1 or image_size % factor:
        raise ValueError(
            f"image_size={image_size} must be divisible by 2**(len(channel_mult)-1)={factor} "
            f"for channel_mult={tuple(channel_mult)}"
        )
    resolutions = [image_size // 2 ** i for i in range(len(channel_mult))]
    unused = sorted(set(attention_resolutions) - set(resolutions))
    if unused:
        raise ValueError(
            f"attention_resolutions {unused} never occur: with image_size={image_size} and "
            f"{len(channel_mult)} levels the resolutions are {resolutions}"
        )
    if num_heads < 1 or num_head_channels < 0:
        raise ValueError(f"num_heads must be >= 1 and num_head_channels >= 0, got {num_heads}, {num_head_channels}")
    attended = [model_channels * mult for resolution, mult in zip(resolutions, channel_mult)
                if resolution in attention_resolutions] + [model_channels * channel_mult[-1]]  # + the middle block
    for channels in attended:
        attention_heads(channels, num_heads, num_head_channels)


class UNet(M.Module):
    """The DDPM noise-prediction UNet.

    ``forward(x, t)``: x float32 (N, in_channels, image_size, image_size), t (N,) integer timesteps of the
    original chain; returns (N, out_channels, image_size, image_size), ``out_channels`` defaulting to
    ``in_channels``. Attention is used at the resolutions in ``attention_resolutions`` and always in the
    middle block. ``norm_groups`` and ``norm_eps`` set every GroupNorm (Ho: 32, 1e-6). The time embedding is
    added per channel before a GroupNorm, so it only reaches the output through levels with more than one
    channel per group; small models (the CPU recipe) use fewer groups. ``downsample_padding`` and
    ``time_embedding`` choose between Ho's network (the defaults), pytorch-ddpm's and improved-diffusion's
    (``nn.options``). improved-diffusion's options: ``use_scale_shift_norm`` (AdaGN in every residual block),
    ``num_heads`` heads in every attention block, or heads of ``num_head_channels`` channels each when that is
    set, and ``out_channels`` = 2 * in_channels for a learned variance. With ``num_classes`` > 0 the network is
    class-conditional (improved-diffusion's ``class_cond``): ``forward(x, t, y)`` adds a learned embedding of the
    class labels y (N,) to the time embedding (nothing for the label ``NO_CLASS``: the unconditional prediction).
    It is made after every other weight, so the other initial weights are those of the unconditional network of the
    same seed.
    """

    def __init__(
        self,
        in_channels=3,
        model_channels=128,
        out_channels=None,
        channel_mult=(1, 2, 2, 2),
        num_res_blocks=2,
        attention_resolutions=(16,),
        dropout=0.1,
        image_size=32,
        norm_groups=NORM_GROUPS,
        norm_eps=NORM_EPS,
        downsample_padding=DOWNSAMPLE_PADDING,
        time_embedding=TIME_EMBEDDING,
        use_scale_shift_norm=False,
        num_heads=1,
        num_head_channels=0,
        num_classes=0,
    ):
        super().__init__()
        check_config(model_channels, channel_mult, attention_resolutions, image_size, norm_groups, norm_eps,
                     downsample_padding, time_embedding, num_heads, num_head_channels, use_scale_shift_norm)
        self.model_channels = model_channels
        self.image_size = image_size
        self.time_embedding = time_embedding
        self.no_class = NO_CLASS  # the label that adds no class embedding, for readers of the module tree (cpu/)
        norm = functools.partial(group_norm, groups=norm_groups, eps=norm_eps)
        block = functools.partial(ResBlock, dropout=dropout, norm=norm, scale_shift=use_scale_shift_norm)

        def attention(channels):
            return AttnBlock(channels, norm, attention_heads(channels, num_heads, num_head_channels))

        temb_channels = 4 * model_channels
        self.temb_dense0 = linear(model_channels, temb_channels)
        self.temb_dense1 = linear(temb_channels, temb_channels)
        self.conv_in = conv2d(in_channels, model_channels)

        # Channel count of every tensor the down path hands to the up path, in order.
        skip_channels = [model_channels]
        channels = model_channels
        self.down = []
        for level, mult in enumerate(channel_mult):
            resolution = image_size // 2 ** level
            blocks, attns = [], []
            for _ in range(num_res_blocks):
                out = model_channels * mult
                blocks.append(block(channels, out, temb_channels))
                channels = out
                if resolution in attention_resolutions:
                    attns.append(attention(channels))
                skip_channels.append(channels)
            downsample = None
            if level != len(channel_mult) - 1:
                downsample = Downsample(channels, downsample_padding)
                skip_channels.append(channels)
            self.down.append(DownLevel(blocks, attns, downsample))

        self.mid_block1 = block(channels, channels, temb_channels)
        self.mid_attn = attention(channels)
        self.mid_block2 = block(channels, channels, temb_channels)

        up_levels = []
        for level, mult in reversed(list(enumerate(channel_mult))):
            resolution = image_size // 2 ** level
            blocks, attns = [], []
            for _ in range(num_res_blocks + 1):
                out = model_channels * mult
                blocks.append(block(channels + skip_channels.pop(), out, temb_channels))
                channels = out
                if resolution in attention_resolutions:
                    attns.append(attention(channels))
            up_levels.append(UpLevel(blocks, attns, Upsample(channels) if level != 0 else None))
        assert not skip_channels
        self.up = up_levels[::-1]  # indexed by level, like down; forward walks it in reverse

        self.norm_out = norm(channels)
        self.conv_out = conv2d(channels, out_channels or in_channels, init_scale=0.0)
        self.num_classes = num_classes
        self.class_emb = M.Embedding(num_classes, temb_channels) if num_classes else None

    def timestep_input(self, t):
        """The sinusoidal embedding (N, model_channels) of timesteps t (N,), the time embedding's input."""
        return timestep_embedding(t, self.model_channels, self.time_embedding)

    def embed_time(self, t):
        """The time embedding (N, 4 * model_channels) of timesteps t (N,), integer or fractional."""
        return self.temb_dense1(silu(self.temb_dense0(self.timestep_input(t))))

    def encode(self, x, temb):
        """The down path and the middle block: (the middle block's output, every output the up path takes,
        starting with conv_in's)."""
        if x.ndim != 4 or x.shape[2] != self.image_size or x.shape[3] != self.image_size:
            raise ValueError(
                f"UNet built for {self.image_size}x{self.image_size} inputs got shape {tuple(x.shape)}"
            )
        hs = [self.conv_in(x)]
        for level in self.down:
            hs.extend(level(hs[-1], temb))
        return self.mid_block2(self.mid_attn(self.mid_block1(hs[-1], temb)), temb), hs

    def forward(self, x, t, y=None):
        temb = self.embed_time(t)
        if (y is None) != (self.class_emb is None):
            raise ValueError(f"a class-conditional network ({self.num_classes} classes) needs class labels y"
                             if y is None else "an unconditional network takes no class labels")
        if y is not None:
            known = (y != NO_CLASS).astype("float32")
            temb = temb + self.class_emb(F.maximum(y, 0)) * F.expand_dims(known, 1)
        h, hs = self.encode(x, temb)
        for level in reversed(self.up):
            h = level(h, temb, hs)
        return self.conv_out(silu(self.norm_out(h)))
