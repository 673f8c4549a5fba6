"""The nearest-2x upsample shim, and the MegEngine 1.9 scenario it exists for (train step, clip, forward);
the same with a whole UNet is tests/test_training.py's train-step test."""
import numpy as np
import pytest

from megdiffusion.compat import quiet_megengine, upsample_nearest_2x

mge = quiet_megengine()
import megengine.functional as F  # noqa: E402
import megengine.module as M  # noqa: E402
from megengine.autodiff import GradManager  # noqa: E402
from megengine.optimizer import Adam, clip_grad_norm  # noqa: E402

from megdiffusion.cpu.conv import Conv2d  # noqa: E402


def test_upsample_nearest_2x_repeats_pixels():
    x = np.arange(2 * 3 * 2 * 3, dtype=np.float32).reshape(2, 3, 2, 3)
    out = upsample_nearest_2x(mge.Tensor(x))
    assert out.shape == (2, 3, 4, 6)
    np.testing.assert_array_equal(out.numpy(), x.repeat(2, axis=2).repeat(2, axis=3))


class SeedModel(M.Module):
    """The seed bug's minimal model: conv -> nearest interpolate -> conv."""

    def __init__(self, resize):
        super().__init__()
        self.conv1 = Conv2d(2, 4, 3, padding=1)
        self.conv2 = Conv2d(4, 2, 3, padding=1)
        self.resize = resize

    def forward(self, x):
        return self.conv2(self.resize(self.conv1(x)))


def train_step_then_forward(model, inputs, loss_fn):
    """backward, clip_grad_norm, Adam step, then the forward pass that used to fail."""
    params = list(model.parameters())
    gm = GradManager().attach(params)
    opt = Adam(params, lr=1e-3)
    before = [p.numpy().copy() for p in params]
    with gm:
        loss = loss_fn(model(*inputs)) + 0
        gm.backward(loss)
    norm = float(clip_grad_norm(params, max_norm=1e-3))
    opt.step().clear_grad()
    assert norm > 0
    assert any(np.abs(p.numpy() - b).max() > 0 for p, b in zip(params, before))
    return model(*inputs)


@pytest.mark.parametrize(
    "resize",
    [lambda x: F.nn.interpolate(x, scale_factor=1, mode="nearest"), upsample_nearest_2x],
    ids=["interpolate_scale1", "shim"],
)
def test_seed_scenario(synchronous, resize):
    rng = np.random.default_rng(0)
    x = mge.Tensor(rng.standard_normal((2, 2, 6, 6)).astype(np.float32))
    with synchronous():
        out = train_step_then_forward(SeedModel(resize), [x], lambda y: y.mean())
    scale = 1 if resize is not upsample_nearest_2x else 2
    assert out.shape == (2, 2, 6 * scale, 6 * scale)
    assert np.isfinite(out.numpy()).all()
