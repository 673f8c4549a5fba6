"""Improved DDPM through the commands: a tiny learned-range run trained with the hybrid loss samples with
improved-diffusion's respacing (DDPM and DDIM) and is scored in bits/dim by ``scripts.nll``."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from megdiffusion import sampling
from megdiffusion.metrics import evaluate
from megdiffusion.compat import quiet_megengine
from megdiffusion.diffusion.spacing import space_timesteps
from megdiffusion.diffusion.generation import generate_images
from megdiffusion.diffusion.sampler_settings import SamplerSettings
from megdiffusion.training.trainer import TrainingRun

quiet_megengine()

IMPROVED = dict(var_type="learned_range", loss_type="hybrid", use_scale_shift_norm=True, num_heads=2,
                beta_schedule="cosine", rescale_timesteps=True, time_embedding="iddpm")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory, tiny_config, tiny_images):
    """A tiny improved run (8x8 gray, T=40), 3 steps with a fast EMA; its data in ``data.npz`` beside it."""
    root = tmp_path_factory.mktemp("improved")
    np.savez(root / "data.npz", arr_0=tiny_images(16))
    cfg = tiny_config(lr=1e-2, ema_decay=0.5, total_steps=3, logdir=str(root / "run"), **IMPROVED)
    TrainingRun(cfg, tiny_images(16), progress=False).run()
    return root / "run"


def run_script(name, *args):
    return subprocess.run([sys.executable, "-m", f"megdiffusion.scripts.{name}", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_the_run_learns_a_variance_and_samples_with_respacing(logdir, tmp_path):
    model, diffusion, cfg, step = sampling.load_model(str(logdir))
    assert step == 3 and diffusion.learns_variance and cfg.loss_type == "hybrid"
    assert model.conv_out.weight.shape[0] == 2  # eps and the variance values of one gray channel
    out = tmp_path / "out"
    result = run_script("sample", f"--ckpt={logdir}", f"--output={out}", "--num_images=3", "--batch_size=2",
                        "--sampler=ddpm", "--respacing=5")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "manifest.json").read_text())["respacing"] == "5"
    expected = generate_images(model, diffusion, (1, 8, 8), range(3), 0, SamplerSettings("ddpm", respacing="5"))
    np.testing.assert_array_equal(sampling.read_samples(out, 3), expected)
    ddim = generate_images(model, diffusion, (1, 8, 8), range(3), 0, SamplerSettings("ddim", respacing="ddim5"))
    assert not np.array_equal(ddim, expected)
    refused = run_script("sample", f"--ckpt={logdir}", f"--output={tmp_path / 'other'}", "--num_images=1",
                         "--steps=5", "--respacing=5")
    assert refused.returncode == 2 and "give steps or respacing, not both" in refused.stderr


def test_bits_per_dim_of_an_image_does_not_depend_on_its_batch(logdir):
    model, diffusion, _, _ = sampling.load_model(str(logdir))
    chain = diffusion.respaced(respacing="4")
    images = np.load(logdir.parent / "data.npz")["arr_0"][:3]
    together = evaluate.bits_per_dim(model, chain, images, seed=1, batch_size=3)
    alone = evaluate.bits_per_dim(model, chain, images, seed=1, batch_size=1)
    other_seed = evaluate.bits_per_dim(model, chain, images, seed=2, batch_size=3)
    np.testing.assert_allclose(together["total_bpd"], alone["total_bpd"], rtol=1e-5)
    assert not np.allclose(together["total_bpd"], other_seed["total_bpd"], rtol=1e-5)
    assert together["vb"].shape == (3, 4) and np.isfinite(together["total_bpd"]).all()
    np.testing.assert_allclose(together["total_bpd"], together["vb"].sum(axis=1) + together["prior_bpd"])
    assert chain.timestep_map.tolist() == space_timesteps(40, "4")


def test_nll_script_prints_the_mean_bound(logdir):
    model, diffusion, _, step = sampling.load_model(str(logdir))
    images = np.load(logdir.parent / "data.npz")["arr_0"][:3]
    expected = evaluate.bits_per_dim(model, diffusion.respaced(respacing="4"), images, batch_size=3)
    result = run_script("nll", f"--ckpt={logdir}", "--respacing=4", "--num_images=3", "--batch_size=2",
                        logdir.parent / "data.npz")
    assert result.returncode == 0, result.stderr
    printed = re.search(r"NLL: ([0-9.]+) bits/dim \(standard error ([0-9.]+); 3 images of .*, EMA weights of .* step "
                        r"3, 4 of T=40 timesteps\); prior term ([0-9.]+), decoder term \(t = 0\) ([0-9.]+)",
                        result.stdout)
    assert printed, result.stdout
    assert float(printed.group(1)) == pytest.approx(expected["total_bpd"].mean(), abs=1e-4)
    assert float(printed.group(2)) == pytest.approx(expected["total_bpd"].std(ddof=1) / np.sqrt(3), abs=1e-4)
    assert float(printed.group(4)) == pytest.approx(expected["vb"][:, 0].mean(), abs=1e-4)
    assert "\r" not in result.stderr  # progress to a pipe: whole lines (none in a run this short), no redraws
