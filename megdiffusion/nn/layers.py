"""Building blocks of the DDPM UNet, following Ho et al. 2020 (``diffusion_tf/models/unet.py``).

Every convolution is ``megdiffusion.cpu.conv.Conv2d``. Weights use Ho's ``default_init``: variance
scaling with fan-avg and a uniform distribution (Xavier-uniform; ``init_scale=0`` means 1e-10, the
"near-zero" init of the last conv of a residual block, the attention output and the output conv).
Biases start at zero.
"""
import math

import numpy as np

import megengine.functional as F
import megengine.module as M
from megengine import Tensor

from megdiffusion.compat import upsample_nearest_2x
from megdiffusion.cpu.conv import Conv2d
from megdiffusion.nn.options import DOWNSAMPLE_PADDING, NORM_EPS, NORM_GROUPS, TIME_EMBEDDING


def variance_scaling_(weight, init_scale=1.0):
    """Ho's ``default_init(scale)``: U(-a, a) with a = sqrt(3 * scale / fan_avg); scale 0 -> 1e-10."""
    scale = init_scale if init_scale > 0 else 1e-10
    M.init.xavier_uniform_(weight, gain=math.sqrt(scale))


def conv2d(in_channels, out_channels, kernel_size=3, stride=1, init_scale=1.0, padding=None):
    """A ``Conv2d`` with Ho's init (zero bias), "same"-padded (``kernel_size // 2``) unless ``padding`` is given."""
    padding = kernel_size // 2 if padding is None else padding
    conv = Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding)
    variance_scaling_(conv.weight, init_scale)
    M.init.zeros_(conv.bias)
    return conv


def linear(in_features, out_features, init_scale=1.0):
    """A ``Linear`` with Ho's init (zero bias)."""
    layer = M.Linear(in_features, out_features)
    variance_scaling_(layer.weight, init_scale)
    M.init.zeros_(layer.bias)
    return layer


def group_norm(channels, groups=NORM_GROUPS, eps=NORM_EPS):
    """GroupNorm(groups, channels, eps) with affine parameters (Ho: 32 groups, eps 1e-6)."""
    return M.GroupNorm(groups, channels, eps=eps)


def silu(x):
    """Swish/SiLU, x * sigmoid(x). Written out: on CPU a training step was faster than with ``F.silu`` (forward
    plus backward), with the same values up to rounding (benchmarks/README.md, "Design choices measured")."""
    return x * F.sigmoid(x)


def timestep_frequencies(dim, kind=TIME_EMBEDDING):
    """The dim / 2 frequencies (float32) of ``timestep_embedding``, made in float64 and rounded once."""
    if dim % 2 or dim < 4:
        raise ValueError(f"timestep embedding dim must be even and >= 4, got {dim}")
    half = dim // 2
    steps = np.arange(half, dtype=np.float64)
    exponents = {"ho": steps / (half - 1), "pytorch_ddpm": 2 * steps / dim, "iddpm": steps / half}[kind]
    return np.exp(-math.log(10000.0) * exponents).astype(np.float32)


def timestep_embedding(t, dim, kind=TIME_EMBEDDING):
    """The sinusoidal embedding of integer (or fractional) timesteps ``t`` (shape (N,)) -> (N, dim).

    ``kind`` "ho": half = dim / 2, frequencies exp(-log(10000) * i / (half - 1)) for i = 0..half-1, then
    [sin, cos]. "pytorch_ddpm": frequencies exp(-log(10000) * 2i / dim), then sin and cos interleaved
    (sin f0, cos f0, sin f1, ...), the rows of pytorch-ddpm's table. "iddpm" (improved-diffusion): frequencies
    exp(-log(10000) * i / half), then [cos, sin]. Computed per call: the table is not a parameter and never
    reaches a checkpoint.
    """
    args = F.expand_dims(t.astype("float32"), 1) * Tensor(timestep_frequencies(dim, kind)[None, :])
    if kind == "ho":
        return F.concat([F.sin(args), F.cos(args)], axis=1)
    if kind == "iddpm":
        return F.concat([F.cos(args), F.sin(args)], axis=1)
    return F.stack([F.sin(args), F.cos(args)], axis=2).reshape(-1, dim)


class ResBlock(M.Module):
    """GN, SiLU, conv3x3, + Linear(SiLU(temb)), GN, SiLU, dropout, conv3x3 (near zero), plus the skip.

    With ``scale_shift`` (improved-diffusion's ``use_scale_shift_norm``, AdaGN) the projection gives 2 * out
    values, scale first, and the second norm becomes GN(h) * (1 + scale) + shift instead of GN(h + temb).
    The skip is a 1x1 conv (Ho's ``nin_shortcut``) when the channel count changes, else identity.
    """

    def __init__(self, in_channels, out_channels, temb_channels, dropout, norm=group_norm, scale_shift=False):
        super().__init__()
        self.scale_shift = scale_shift
        self.norm1 = norm(in_channels)
        self.conv1 = conv2d(in_channels, out_channels)
        self.temb_proj = linear(temb_channels, 2 * out_channels if scale_shift else out_channels)
        self.norm2 = norm(out_channels)
        self.dropout = M.Dropout(dropout)
        self.conv2 = conv2d(out_channels, out_channels, init_scale=0.0)
        self.skip = conv2d(in_channels, out_channels, kernel_size=1) if in_channels != out_channels else None

    def forward(self, x, temb):
        h = self.conv1(silu(self.norm1(x)))
        emb = F.expand_dims(self.temb_proj(silu(temb)), (2, 3))
        if self.scale_shift:
            scale, shift = F.split(emb, 2, axis=1)
            h = self.norm2(h) * (1.0 + scale) + shift
        else:
            h = self.norm2(h + emb)
        h = self.conv2(self.dropout(silu(h)))
        if self.skip is not None:
            x = self.skip(x)
        return x + h


class AttnBlock(M.Module):
    """Self-attention over all positions: GN, 1x1 q/k/v, softmax(q k^T / sqrt(d)) v per head, 1x1 proj.

    ``num_heads`` heads of d = C / num_heads channels each; head i uses channels i*d .. (i+1)*d - 1 of q, k and
    v (Ho's network: one head).
    """

    def __init__(self, channels, norm=group_norm, num_heads=1):
        super().__init__()
        if num_heads < 1 or channels % num_heads:
            raise ValueError(f"attention over {channels} channels cannot have {num_heads} heads")
        self.num_heads = num_heads
        self.norm = norm(channels)
        self.q = conv2d(channels, channels, kernel_size=1)
        self.k = conv2d(channels, channels, kernel_size=1)
        self.v = conv2d(channels, channels, kernel_size=1)
        self.proj_out = conv2d(channels, channels, kernel_size=1, init_scale=0.0)

    def forward(self, x):
        n, c, height, width = x.shape
        h = self.norm(x)
        heads, d = self.num_heads, c // self.num_heads
        q = self.q(h).reshape(n * heads, d, height * width)
        k = self.k(h).reshape(n * heads, d, height * width)
        v = self.v(h).reshape(n * heads, d, height * width)
        if q.dtype == np.float16:
            # Mixed precision (--amp): a sum over d products of float16 can overflow, so q and k are scaled before
            # it (as improved-diffusion does), and the softmax, whose exponentials float16 would flush, runs in
            # float32 (so then does the product with v).
            logits = F.matmul(q * d ** -0.25, k * d ** -0.25, transpose_a=True).astype("float32")
        else:
            logits = F.matmul(q, k, transpose_a=True) * (d ** -0.5)
        weights = F.softmax(logits, axis=2)  # (n * heads, query, key)
        h = F.matmul(v, weights, transpose_b=True).reshape(n, c, height, width)  # sum over keys
        return x + self.proj_out(h)


class Downsample(M.Module):
    """3x3 convolution with stride 2. ``padding`` "bottom_right": one row and column of zeros at the bottom
    and right (TF's "SAME" on even sizes, Ho's network); "symmetric": one on every side."""

    def __init__(self, channels, padding=DOWNSAMPLE_PADDING):
        super().__init__()
        self.bottom_right = padding == "bottom_right"
        self.conv = conv2d(channels, channels, stride=2, padding=0 if self.bottom_right else 1)

    def forward(self, x):
        if self.bottom_right:
            x = F.nn.pad(x, ((0, 0), (0, 0), (0, 1), (0, 1)))
        return self.conv(x)


class Upsample(M.Module):
    """Nearest-neighbour 2x (through the MegEngine 1.9 shim) followed by a 3x3 convolution."""

    def __init__(self, channels):
        super().__init__()
        self.conv = conv2d(channels, channels)

    def forward(self, x):
        return self.conv(upsample_nearest_2x(x))
