"""What many tests share: the tiny training config and the random images they train on."""
import contextlib

import numpy as np
import pytest

from megdiffusion.training.config import TrainConfig, as_flag

# A one-level 32-channel UNet on 8x8 gray images with T=40: a few CPU steps per second.
TINY = dict(image_size=8, image_channels=1, model_channels=32, channel_mult=(1,), norm_groups=8, num_res_blocks=1,
            attention_resolutions=(), dropout=0.0, num_timesteps=40, batch_size=8, warmup_steps=0, sample_every=0,
            save_every=0)


@pytest.fixture(scope="session")
def tiny_config():
    """``tiny_config(**changes)``: the tiny ``TrainConfig`` with some fields changed."""
    return lambda **changes: TrainConfig(**{**TINY, **changes})


@pytest.fixture(scope="session")
def tiny_model_flags():
    """The tiny config's model as command-line flags, for the scripts."""
    names = ("model_channels", "channel_mult", "norm_groups", "num_res_blocks", "attention_resolutions")
    return [as_flag(name, TINY[name]) for name in names]


@pytest.fixture(scope="session")
def tiny_images():
    """``tiny_images(n)``: n random 8x8 gray uint8 images, the same for every call with the same n."""
    return lambda n: np.random.default_rng(0).integers(0, 256, size=(n, 8, 8, 1), dtype=np.uint8)


@pytest.fixture(scope="session")
def synchronous():
    """``with synchronous():`` runs MegEngine at async_level 0, where shape inference is checked eagerly
    (where MegEngine 1.9's upsample bug showed, see ``compat.upsample_nearest_2x``)."""
    from megdiffusion.compat import quiet_megengine

    @contextlib.contextmanager
    def scope():
        config = quiet_megengine().config
        old = config.async_level
        config.async_level = 0
        try:
            yield
        finally:
            config.async_level = old

    return scope


# Runs an ONNX file in onnxruntime in its own process: once a session has run in a process, MegEngine's and the
# CPU engine's float32 results there part in the denormals (test_training's flat update kept exp_avg_sq values of
# ~1e-41 where MegEngine's Adam gave 0), and the bit-for-bit comparisons of other test files fail.
_ONNXRUNTIME = """
import sys
import numpy as np
import onnxruntime
feeds = dict(np.load(sys.argv[2]))
session = onnxruntime.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
np.save(sys.argv[3], session.run(["out"], feeds)[0])
"""


@pytest.fixture(scope="session")
def onnxruntime_out(tmp_path_factory):
    """``onnxruntime_out(path, feeds)``: onnxruntime's output ``out`` of the ONNX file at ``path`` on ``feeds`` (a
    dict of arrays), computed in a fresh process; skips where onnxruntime is not installed."""
    import subprocess
    import sys

    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e .[dev])")
    directory = tmp_path_factory.mktemp("onnxruntime")

    def run(path, feeds):
        np.savez(directory / "feeds.npz", **feeds)
        result = subprocess.run([sys.executable, "-c", _ONNXRUNTIME, str(path), str(directory / "feeds.npz"),
                                 str(directory / "out.npy")], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return np.load(directory / "out.npy")

    return run


@pytest.fixture(scope="session")
def diffusers_run(tmp_path_factory):
    """``diffusers_run(pipeline, x=, t=, x_T=[, y=])``: what ``tests/diffusers_side.py`` computes with diffusers on
    the exported pipeline directory (its ``UNet2DModel`` output ``out``, two scheduler steps), in the python
    ``MEGDIFFUSION_TORCH_PYTHON`` names; skips where that is unset or lacks torch or diffusers."""
    import os
    import subprocess
    from pathlib import Path

    python = os.environ.get("MEGDIFFUSION_TORCH_PYTHON")
    if not python:
        pytest.skip("diffusers' side needs MEGDIFFUSION_TORCH_PYTHON: a python with torch and diffusers")
    check = subprocess.run([python, "-c", "import diffusers, torch"], capture_output=True, text=True)
    if check.returncode:
        pytest.skip(f"{python} cannot import diffusers and torch: {check.stderr.strip().splitlines()[-1]}")
    directory = tmp_path_factory.mktemp("diffusers")
    side = Path(__file__).parent / "diffusers_side.py"

    def run(pipeline, **arrays):
        np.savez(directory / "in.npz", **arrays)
        result = subprocess.run([python, str(side), str(pipeline), str(directory / "in.npz"),
                                 str(directory / "out.npz")], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        return dict(np.load(directory / "out.npz"))

    return run
