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
from megdiffusion.nn.options import NO_CLASS, UNetConfig, attention_heads


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


class UNet(M.Module):
    """The DDPM noise-prediction UNet of a ``UNetConfig`` (or of its fields, as keywords).

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

    def __init__(self, config=None, **options):
        if config is not None and options:
            raise TypeError("UNet takes a UNetConfig or its fields as keywords, not both")
        super().__init__()
        self.config = config = config or UNetConfig(**options)  # a UNetConfig checks itself when made
        self.model_channels = config.model_channels
        self.image_size = config.image_size
        self.time_embedding = config.time_embedding
        self.no_class = NO_CLASS  # the label that adds no class embedding, for readers of the module tree (cpu/)
        norm = functools.partial(group_norm, groups=config.norm_groups, eps=config.norm_eps)
        block = functools.partial(ResBlock, dropout=config.dropout, norm=norm, scale_shift=config.use_scale_shift_norm)

        def attention(channels):
            return AttnBlock(channels, norm, attention_heads(channels, config.num_heads, config.num_head_channels))

        temb_channels = 4 * config.model_channels
        self.temb_dense0 = linear(config.model_channels, temb_channels)
        self.temb_dense1 = linear(temb_channels, temb_channels)
        self.conv_in = conv2d(config.in_channels, config.model_channels)

        # Channel count of every tensor the down path hands to the up path, in order.
        skip_channels = [config.model_channels]
        channels = config.model_channels
        self.down = []
        for level, mult in enumerate(config.channel_mult):
            resolution = config.image_size // 2 ** level
            blocks, attns = [], []
            for _ in range(config.num_res_blocks):
                out = config.model_channels * mult
                blocks.append(block(channels, out, temb_channels))
                channels = out
                if resolution in config.attention_resolutions:
                    attns.append(attention(channels))
                skip_channels.append(channels)
            downsample = None
            if level != len(config.channel_mult) - 1:
                downsample = Downsample(channels, config.downsample_padding)
                skip_channels.append(channels)
            self.down.append(DownLevel(blocks, attns, downsample))

        self.mid_block1 = block(channels, channels, temb_channels)
        self.mid_attn = attention(channels)
        self.mid_block2 = block(channels, channels, temb_channels)

        up_levels = []
        for level, mult in reversed(list(enumerate(config.channel_mult))):
            resolution = config.image_size // 2 ** level
            blocks, attns = [], []
            for _ in range(config.num_res_blocks + 1):
                out = config.model_channels * mult
                blocks.append(block(channels + skip_channels.pop(), out, temb_channels))
                channels = out
                if resolution in config.attention_resolutions:
                    attns.append(attention(channels))
            up_levels.append(UpLevel(blocks, attns, Upsample(channels) if level != 0 else None))
        assert not skip_channels
        self.up = up_levels[::-1]  # indexed by level, like down; forward walks it in reverse

        self.norm_out = norm(channels)
        self.conv_out = conv2d(channels, config.out_channels or config.in_channels, init_scale=0.0)
        self.num_classes = config.num_classes
        self.class_emb = M.Embedding(config.num_classes, temb_channels) if config.num_classes else None

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
