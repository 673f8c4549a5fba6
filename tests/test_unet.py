"""UNet: parameter counts, init, layers against numpy references, config checks, shapes (its train step:
tests/test_training.py)."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from megdiffusion.compat import assign_, quiet_megengine

mge = quiet_megengine()
import megengine.module as M  # noqa: E402

from megdiffusion.nn import UNet  # noqa: E402
from megdiffusion.nn.options import NO_CLASS  # noqa: E402
from megdiffusion.nn.layers import AttnBlock, Downsample, ResBlock, timestep_embedding  # noqa: E402

# 64 channels at the second level: with 32 channels in 32 groups, GroupNorm removes the per-channel
# time-embedding shift, and such a UNet would ignore t.
TINY = dict(in_channels=1, model_channels=32, channel_mult=(1, 2), num_res_blocks=1,
            attention_resolutions=(4,), dropout=0.1, image_size=8)


def expected_parameters(in_ch, ch, mult, num_res_blocks, attn_res, image_size, out_ch=None, scale_shift=False):
    """Parameter count of Ho's UNet, by hand: conv k*k*i*o + o, linear i*o + o, GroupNorm 2c; with
    ``scale_shift`` each residual block's time projection gives a scale and a shift per channel."""
    conv = lambda i, o, k=3: k * k * i * o + o  # noqa: E731
    norm = lambda c: 2 * c  # noqa: E731
    temb = 4 * ch
    projections = 2 if scale_shift else 1

    def res(i, o):
        return (norm(i) + conv(i, o) + projections * (temb * o + o) + norm(o) + conv(o, o)
                + (conv(i, o, 1) if i != o else 0))

    def attn(c):
        return norm(c) + 4 * conv(c, c, 1)

    total = (ch * temb + temb) + (temb * temb + temb) + conv(in_ch, ch)
    skips, cur = [ch], ch
    for level, m in enumerate(mult):
        for _ in range(num_res_blocks):
            total += res(cur, ch * m) + (attn(ch * m) if image_size >> level in attn_res else 0)
            cur = ch * m
            skips.append(cur)
        if level < len(mult) - 1:
            total += conv(cur, cur)
            skips.append(cur)
    total += 2 * res(cur, cur) + attn(cur)
    for level in reversed(range(len(mult))):
        for _ in range(num_res_blocks + 1):
            total += res(cur + skips.pop(), ch * mult[level])
            cur = ch * mult[level]
            total += attn(cur) if image_size >> level in attn_res else 0
        if level > 0:
            total += conv(cur, cur)
    return total + norm(cur) + conv(cur, out_ch or in_ch)


def count(model):
    return sum(int(np.prod(p.shape)) for p in model.parameters())


def test_cifar10_config_has_the_paper_parameter_count():
    model = UNet()  # the defaults are the paper's CIFAR-10 config
    assert count(model) == 35_746_307
    assert expected_parameters(3, 128, (1, 2, 2, 2), 2, (16,), 32) == 35_746_307


def test_improved_diffusions_cifar10_recipe_parameter_count():
    # configs/iddpm_cifar10.cfg's network (improved-diffusion's cifar10_uncond_50M_500K): 3 blocks, attention at
    # 16 and 8 pixels in 4 heads, scale-shift norm, 6 output channels for the learned variance.
    model = UNet(num_res_blocks=3, attention_resolutions=(16, 8), out_channels=6, use_scale_shift_norm=True,
                 num_heads=4, dropout=0.3, norm_eps=1e-5, downsample_padding="symmetric", time_embedding="iddpm")
    expected = expected_parameters(3, 128, (1, 2, 2, 2), 3, (16, 8), 32, out_ch=6, scale_shift=True)
    assert count(model) == expected == 52_546_438


def test_256_config_parameter_count():
    # Constructing it takes a few seconds; no forward pass on 256x256 inputs.
    model = UNet(channel_mult=(1, 1, 2, 2, 4, 4), image_size=256)
    expected = expected_parameters(3, 128, (1, 1, 2, 2, 4, 4), 2, (16,), 256)
    assert count(model) == expected
    assert 113.5e6 < expected < 114.5e6  # the paper's "114M"


def test_state_dict_holds_only_parameters():
    model = UNet(**TINY)
    names = [name for name, _ in model.named_parameters()]
    assert sorted(model.state_dict()) == sorted(names)  # no embedding table or other buffer
    assert not list(model.buffers())


def test_timestep_embedding_is_hos_formula():
    t = np.array([0, 1, 17, 999])
    dim = 8
    half = dim // 2
    freqs = [math.exp(-math.log(10000) * i / (half - 1)) for i in range(half)]
    expected = np.array([[math.sin(s * f) for f in freqs] + [math.cos(s * f) for f in freqs] for s in t])
    got = timestep_embedding(mge.Tensor(t, dtype="int32"), dim).numpy()
    np.testing.assert_allclose(got, expected, atol=2e-4)


def test_timestep_embedding_iddpm_is_cos_then_sin_over_half():
    t = np.array([0.0, 1.0, 308.5, 999.75])  # improved-diffusion's rescaled timesteps are fractional
    dim = 8
    freqs = [math.exp(-math.log(10000) * i / (dim // 2)) for i in range(dim // 2)]
    expected = np.array([[math.cos(s * f) for f in freqs] + [math.sin(s * f) for f in freqs] for s in t])
    got = timestep_embedding(mge.Tensor(t, dtype="float32"), dim, "iddpm").numpy()
    np.testing.assert_allclose(got, expected, atol=2e-4)


def test_scale_shift_norm_is_adagn():
    rng = np.random.default_rng(2)
    block = ResBlock(8, 8, 12, dropout=0.0, norm=lambda c: M.GroupNorm(4, c, eps=1e-5), scale_shift=True)
    for p in block.parameters():
        assign_(p, mge.Tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.3))
    assert block.temb_proj.weight.shape == (16, 12)  # a scale and a shift per channel
    x, temb = rng.standard_normal((2, 8, 4, 4)).astype(np.float32), rng.standard_normal((2, 12)).astype(np.float32)

    def norm(module, a):
        g = a.reshape(2, 4, -1)
        g = (g - g.mean(axis=2, keepdims=True)) / np.sqrt(g.var(axis=2, keepdims=True) + 1e-5)
        gamma, beta = module.weight.numpy().reshape(1, -1, 1, 1), module.bias.numpy().reshape(1, -1, 1, 1)
        return g.reshape(a.shape) * gamma + beta

    def conv(module, a):  # a 3x3 "same" convolution through MegEngine's own kernel
        return module.calc_conv(mge.Tensor(a.astype(np.float32)), module.weight, module.bias).numpy()

    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    h = conv(block.conv1, silu(norm(block.norm1, x)))
    emb = silu(temb) @ block.temb_proj.weight.numpy().T + block.temb_proj.bias.numpy()
    scale, shift = emb[:, :8, None, None], emb[:, 8:, None, None]
    expected = x + conv(block.conv2, silu(norm(block.norm2, h) * (1 + scale) + shift))
    got = block(mge.Tensor(x), mge.Tensor(temb)).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_timestep_embedding_pytorch_ddpm_is_its_interleaved_table():
    t = np.array([0, 1, 17, 999])
    dim = 8
    freqs = [math.exp(-math.log(10000) * 2 * i / dim) for i in range(dim // 2)]
    expected = np.array([[f(s * w) for w in freqs for f in (math.sin, math.cos)] for s in t])
    got = timestep_embedding(mge.Tensor(t, dtype="int32"), dim, "pytorch_ddpm").numpy()
    np.testing.assert_allclose(got, expected, atol=2e-4)


def _conv_stride2(x, weight, bias, pad):
    """Reference stride-2 3x3 cross-correlation of x (N, C, H, W) zero-padded by ((top, bottom), (left, right))."""
    x = np.pad(x, ((0, 0), (0, 0)) + pad)
    ho, wo = (x.shape[2] - 3) // 2 + 1, (x.shape[3] - 3) // 2 + 1
    out = np.zeros((x.shape[0], weight.shape[0], ho, wo))
    for i in range(ho):
        for j in range(wo):
            out[:, :, i, j] = np.einsum("nckl,ockl->no", x[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3], weight)
    return out + bias.reshape(1, -1, 1, 1)


@pytest.mark.parametrize("padding, pad", [("bottom_right", ((0, 1), (0, 1))), ("symmetric", ((1, 1), (1, 1)))])
def test_downsample_padding(padding, pad):
    rng = np.random.default_rng(0)
    block = Downsample(4, padding)
    assign_(block.conv.bias, mge.Tensor(rng.standard_normal(block.conv.bias.shape).astype(np.float32)))
    x = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    got = block(mge.Tensor(x)).numpy()
    expected = _conv_stride2(x, block.conv.weight.numpy(), block.conv.bias.numpy(), pad)
    assert got.shape == (2, 4, 3, 3)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_init_follows_ho():
    model = UNet(**TINY)
    params = dict(model.named_parameters())
    near_zero = [n for n in params if n.endswith("conv2.weight") or "proj_out.weight" in n
                 or n == "conv_out.weight"]
    assert len(near_zero) == 8 + 4 + 1  # 8 residual blocks, 4 attention blocks, the output conv
    for name, p in params.items():
        w = p.numpy()
        if name.endswith("bias") and "norm" not in name:
            assert not w.any(), name
        elif name in near_zero:
            assert np.abs(w).max() < 1e-4, name
        elif "norm" in name:
            assert np.all(w == (1.0 if name.endswith("weight") else 0.0)), name
        else:
            fan_in, fan_out = w[0].size, w.shape[0] * w[0, 0].size
            bound = math.sqrt(6.0 / (fan_in + fan_out))  # Xavier-uniform
            assert np.abs(w).max() <= bound * (1 + 1e-6), name
            assert np.abs(w).max() > 0.5 * bound, name
    norms = [m for m in model.modules() if type(m).__name__ == "GroupNorm"]
    assert norms and all(m.num_groups == 32 and m.eps == 1e-6 for m in norms)


@pytest.mark.parametrize("heads", [1, 4])
def test_attention_matches_numpy(heads):
    rng = np.random.default_rng(0)
    block = AttnBlock(64, num_heads=heads)
    for conv in (block.q, block.k, block.v, block.proj_out):
        assign_(conv.weight, mge.Tensor(rng.standard_normal(conv.weight.shape).astype(np.float32) * 0.2))
        assign_(conv.bias, mge.Tensor(rng.standard_normal(conv.bias.shape).astype(np.float32) * 0.2))
    x = rng.standard_normal((2, 64, 3, 4)).astype(np.float32)
    got = block(mge.Tensor(x)).numpy()

    g = x.reshape(2, 32, 2 * 12)  # GroupNorm(32) over 64 channels: two channels per group
    h = ((g - g.mean(axis=2, keepdims=True)) / np.sqrt(g.var(axis=2, keepdims=True) + 1e-6))
    h = h.reshape(2, 64, 12)  # gamma 1, beta 0

    def proj(conv, a):  # a 1x1 convolution over (N, C, positions)
        return np.einsum("oc,ncp->nop", conv.weight.numpy()[:, :, 0, 0], a) + conv.bias.numpy()[:, :, 0]

    q, k, v = (proj(conv, h).reshape(2, heads, 64 // heads, 12) for conv in (block.q, block.k, block.v))
    logits = np.einsum("nhcp,nhcs->nhps", q, k) / math.sqrt(64 // heads)  # head i: channels i*d .. (i+1)*d - 1
    w = np.exp(logits - logits.max(axis=3, keepdims=True))
    w /= w.sum(axis=3, keepdims=True)
    attended = np.einsum("nhps,nhcs->nhcp", w, v).reshape(2, 64, 12)
    expected = x + proj(block.proj_out, attended).reshape(x.shape)
    np.testing.assert_allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(image_size=30), "divisible by"),
        (dict(attention_resolutions=(16, 3)), "never occur"),
        (dict(model_channels=48), "multiples of norm_groups=32"),
        (dict(model_channels=32, channel_mult=(1,)), "cannot see the timestep"),
        (dict(model_channels=32, channel_mult=(1, 2), norm_groups=0), "norm_groups must be positive"),
        (dict(channel_mult=()), "at least one"),
        (dict(downsample_padding="same"), "downsample_padding must be one of bottom_right, symmetric"),
        (dict(time_embedding="flip"), "time_embedding must be one of ho, pytorch_ddpm, iddpm"),
        (dict(norm_eps=0.0), "norm_eps must be positive"),
        (dict(num_heads=3), "attention over 256 channels cannot be split into heads with num_heads=3"),
        (dict(num_head_channels=96), "256 channels cannot be split into heads with num_head_channels=96"),
        (dict(num_head_channels=512), "attention over 256 channels cannot be split"),
        (dict(num_heads=0), "num_heads must be >= 1"),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UNet(**kwargs)


def test_norm_groups_and_eps_set_every_group_norm():
    model = UNet(**dict(TINY, norm_groups=8, norm_eps=1e-5))
    norms = [m for m in model.modules() if isinstance(m, M.GroupNorm)]
    assert norms and all(m.num_groups == 8 and m.eps == 1e-5 for m in norms)


def test_forward_shapes():
    model = UNet(**{**TINY, "out_channels": 2})
    t = mge.Tensor([0, 999], dtype="int32")
    assert model(mge.Tensor(np.zeros((2, 1, 8, 8), np.float32)), t).shape == (2, 2, 8, 8)
    with pytest.raises(ValueError, match="8x8"):
        model(mge.Tensor(np.zeros((2, 1, 16, 16), np.float32)), t)


@pytest.mark.parametrize("config", [TINY, dict(TINY, channel_mult=(1,), attention_resolutions=(), norm_groups=8)])
def test_timesteps_change_the_output(config):
    mge.random.seed(1)
    model = UNet(**config)
    model.eval()
    for name, p in model.named_parameters():  # undo the near-zero init, through which t acts
        if name.endswith(("conv2.weight", "proj_out.weight", "conv_out.weight")):
            assign_(p, p * 1e5)
    x = mge.Tensor(np.ones((2, 1, 8, 8), np.float32))
    out = model(x, mge.Tensor([3, 700], dtype="int32")).numpy()
    assert np.abs(out[0] - out[1]).max() > 1e-3


_ORDER_SCRIPT = (
    "from megdiffusion.compat import quiet_megengine; quiet_megengine()\n"
    "from megdiffusion.nn import UNet\n"
    "m = UNet(in_channels=1, model_channels=32, channel_mult=(1, 2), num_res_blocks=2,"
    " attention_resolutions=(4, 8), image_size=8)\n"
    "print('\\n'.join(f'{n} {tuple(p.shape)}' for n, p in m.named_parameters()))\n"
)


def test_parameter_order_does_not_depend_on_hash_seed():
    outputs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT], env=env, capture_output=True, text=True,
                             check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        outputs.append(run.stdout.splitlines())
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) > 50


def test_class_conditional_unet_adds_a_class_embedding_to_the_time_embedding():
    """num_classes: the embedding table is the only extra weight (the others are the unconditional network's of the
    same seed), its row for y is added to the time embedding (checked through a model whose table rows are set), and
    the labels are required by a conditional network and refused by an unconditional one."""
    mge.random.seed(4)
    plain = UNet(**TINY)
    mge.random.seed(4)
    model = UNet(**TINY, num_classes=3)
    plain_params, params = dict(plain.named_parameters()), dict(model.named_parameters())
    assert sorted(set(params) - set(plain_params)) == ["class_emb.weight"]
    assert params["class_emb.weight"].shape == (3, 4 * TINY["model_channels"])
    for name, p in plain_params.items():
        np.testing.assert_array_equal(p.numpy(), params[name].numpy())
    model.eval()
    x, t = mge.Tensor(np.ones((2, 1, 8, 8), np.float32)), mge.Tensor([5, 5], dtype="int32")
    captured = []
    model.encode = lambda x, temb: (captured.append(temb.numpy()), UNet.encode(model, x, temb))[1]
    model(x, t, mge.Tensor([0, 2], dtype="int32"))
    expected = model.embed_time(t).numpy() + params["class_emb.weight"].numpy()[[0, 2]]
    np.testing.assert_allclose(captured[0], expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="needs class labels"):
        model(x, t)
    with pytest.raises(ValueError, match="takes no class labels"):
        plain(x, t, mge.Tensor([0, 1], dtype="int32"))


def test_the_label_no_class_gives_the_unconditional_network():
    """A class-conditional network called with NO_CLASS adds no class embedding: it is the unconditional network
    with the same other weights (all drawn at random here: the output layer starts at zero), row by row beside rows
    that are given a class."""
    plain, model = UNet(**TINY), UNet(**TINY, num_classes=3)
    rng = np.random.default_rng(1)
    weights = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        value = mge.tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.2)
        assign_(p, value), assign_(weights[name], value)
    assign_(model.class_emb.weight, mge.tensor(rng.standard_normal((3, 4 * TINY["model_channels"])), "float32"))
    plain.eval(), model.eval()
    x = mge.Tensor(np.random.default_rng(0).standard_normal((2, 1, 8, 8)).astype(np.float32))
    t = mge.Tensor([5, 30], dtype="int32")
    out = model(x, t, mge.Tensor([NO_CLASS, 2], dtype="int32")).numpy()
    expected = plain(x, t).numpy()
    np.testing.assert_allclose(out[0], expected[0], rtol=1e-5, atol=1e-6)
    assert np.abs(out[1] - expected[1]).max() > 1e-3
    np.testing.assert_allclose(out[1], model(x, t, mge.Tensor([0, 2], dtype="int32")).numpy()[1], rtol=1e-5,
                               atol=1e-6)
