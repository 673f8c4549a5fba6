"""``formats.onnx_graph``: the UNet written as ONNX gives, under onnxruntime, the outputs MegEngine's eager network
gives, for every layer option and at any batch size."""
import numpy as np
import pytest

from megdiffusion.compat import quiet_megengine
from megdiffusion.formats import ConvertError
from megdiffusion.nn.unet import UNet

mge = quiet_megengine()

UNETS = {
    # Ho's layers: bottom-right padding, [sin | cos] embedding, one attention head, two levels.
    "ho": dict(in_channels=1, model_channels=16, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(4,),
               image_size=8, norm_groups=4),
    # improved-diffusion's: scale-shift norm, [cos | sin], 2 heads, learned variance (doubled output), classes.
    "iddpm": dict(in_channels=3, out_channels=6, model_channels=16, channel_mult=(1, 2), num_res_blocks=2,
                  attention_resolutions=(8, 4), image_size=8, norm_groups=4, time_embedding="iddpm",
                  use_scale_shift_norm=True, num_heads=2, num_classes=5),
    # pytorch-ddpm's: symmetric padding, interleaved embedding, the CPU recipe's odd 7x7 level.
    "pytorch_ddpm": dict(in_channels=1, model_channels=8, channel_mult=(1, 2, 2), num_res_blocks=1,
                         attention_resolutions=(7,), image_size=28, norm_groups=4, downsample_padding="symmetric",
                         time_embedding="pytorch_ddpm"),
}


def randomised(model, seed=0):
    """Every parameter drawn at random: the near-zero inits would hide a wrong layer."""
    rng = np.random.default_rng(seed)
    for p in model.parameters():
        p._reset(mge.tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.2))
    return model


@pytest.mark.parametrize("name", sorted(UNETS))
@pytest.mark.parametrize("batch", [1, 3])
def test_onnxruntime_matches_the_eager_network(tmp_path, onnxruntime_out, name, batch):
    from megdiffusion.formats.onnx_graph import write_onnx

    kwargs = UNETS[name]
    model = randomised(UNet(dropout=0.0, **kwargs))
    model.eval()
    path = tmp_path / "unet.onnx"
    write_onnx(model, path)
    rng = np.random.default_rng(batch)
    size = kwargs["image_size"]
    x = rng.standard_normal((batch, kwargs["in_channels"], size, size)).astype(np.float32)
    t = rng.uniform(0, 999, batch).astype(np.float32)  # fractional timesteps, as a respaced sampler feeds them
    feeds = {"x": x, "t": t}
    args = [mge.tensor(x), mge.tensor(t)]
    if kwargs.get("num_classes"):
        y = np.array([-1, 4, 0][:batch], np.int32)  # -1: no class
        feeds["y"] = y
        args.append(mge.tensor(y))
    expected = model(*args).numpy()
    got = onnxruntime_out(path, feeds)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_training_mode_dropout_is_refused(tmp_path):
    from megdiffusion.formats.onnx_graph import write_onnx

    model = UNet(dropout=0.1, **UNETS["ho"])
    model.train()
    with pytest.raises(ConvertError, match="model.eval"):
        write_onnx(model, tmp_path / "unet.onnx")
    assert not (tmp_path / "unet.onnx").exists()
