"""Conformance of the post-hoc EMA maths with EDM2's equations (the reference set: float64, numpy), at the set's
tolerances.

The set is ``$MEGDIFFUSION_POSTHOC_EMA_REFERENCE`` or tests/fixtures/posthoc_ema. Every case cases.json lists is
checked, with the tolerances read from its ``conventions``; the last test fails if a case was left unchecked.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megdiffusion.training import checkpoint as ckpt
from megdiffusion.training import posthoc_ema as ph

REPO = Path(__file__).resolve().parents[1]

REFERENCE = Path(os.environ.get("MEGDIFFUSION_POSTHOC_EMA_REFERENCE") or REPO / "tests" / "fixtures" / "posthoc_ema")
CASES = json.loads((REFERENCE / "cases.json").read_text())
KINDS = ("sigma_rel_to_gamma", "beta", "inner", "coefficients")
CHECKED = set()  # (kind, index) of each case compared, and ("trajectory", 0)


def tolerance(name):
    """The leading number of the tolerance the conventions give for ``name`` ("1e-12 relative", ...)."""
    [text] = [value for key, value in CASES["conventions"]["tolerance"].items() if name in key.split(", ")]
    return float(re.match(r"[0-9.e+-]+", text).group())


def close(got, expected, rel, scale=None):
    assert abs(got - expected) <= rel * abs(expected if scale is None else scale), (got, expected, rel)


def test_the_set_uses_our_conventions():
    conventions = CASES["conventions"]
    assert conventions["dtype"] == "float64"
    assert conventions["t"].startswith("images seen after the step (t_next)")
    assert {kind for kind in KINDS} <= set(CASES)


@pytest.mark.parametrize("index", range(len(CASES["sigma_rel_to_gamma"])))
def test_gamma_and_back(index):
    case = CASES["sigma_rel_to_gamma"][index]
    close(ph.gamma_of(case["sigma_rel"]), case["gamma"], tolerance("gamma"))
    close(ph.sigma_rel_of(case["gamma"]), case["sigma_rel_back"], tolerance("gamma"))
    CHECKED.add(("sigma_rel_to_gamma", index))


@pytest.mark.parametrize("index", range(len(CASES["beta"])))
def test_beta(index):
    case = CASES["beta"][index]
    close(ph.beta(ph.gamma_of(case["sigma_rel"]), case["t_next"], case["t_delta"]), case["beta"], tolerance("beta"))
    CHECKED.add(("beta", index))


@pytest.mark.parametrize("index", range(len(CASES["inner"])))
def test_inner_product(index):
    case = CASES["inner"][index]
    got = ph.inner(case["t_a"], ph.gamma_of(case["sigma_rel_a"]), case["t_b"], ph.gamma_of(case["sigma_rel_b"]))
    close(got, case["inner"], tolerance("inner"))
    CHECKED.add(("inner", index))


@pytest.mark.parametrize("index", range(len(CASES["coefficients"])))
def test_coefficients(index):
    case = CASES["coefficients"][index]
    weights, condition = ph.coefficients(case["snapshots"], case["target"])
    close(condition, case["condition_number"], 1e-6)
    rel = tolerance("coefficients") * case["condition_number"]
    largest = max(abs(c) for c in case["coefficients"])
    assert len(weights) == len(case["coefficients"])
    for got, expected in zip(weights, case["coefficients"]):
        close(got, expected, rel, scale=largest)
    CHECKED.add(("coefficients", index))


def test_a_tracked_trajectory_and_its_reconstruction():
    spec = CASES["trajectory"]
    data = np.load(REFERENCE / spec["file"])
    steps, batch, every = spec["steps"], spec["batch"], spec["snapshot_every"]
    raw = data["raw"]
    assert raw.shape == (steps + 1, spec["dims"])
    tracker, target = ph.Tracker(raw[0], spec["profiles"]), ph.Tracker(raw[0], [spec["target"]])
    snapshots, profiles = [], []
    for step in range(1, steps + 1):
        tracker.update(raw[step], step * batch, batch)
        target.update(raw[step], step * batch, batch)
        if step % every == 0:
            snapshots += [average.copy() for average in tracker.averages]
            profiles += [(step * batch, s) for s in spec["profiles"]]
    rel = tolerance("trajectory")
    np.testing.assert_allclose(profiles, data["snapshot_profiles"], rtol=0)
    np.testing.assert_allclose(snapshots, data["snapshots"], rtol=0, atol=rel * np.abs(data["snapshots"]).max())
    weights, condition = ph.coefficients(profiles, (steps * batch, spec["target"]))
    close(condition, spec["condition_number"], 1e-6)
    np.testing.assert_allclose(weights, data["coefficients"], rtol=0,
                               atol=tolerance("coefficients") * condition * np.abs(data["coefficients"]).max())
    reconstructed = weights @ np.array(snapshots)
    scale = np.abs(data["reconstructed"]).max()
    np.testing.assert_allclose(reconstructed, data["reconstructed"], rtol=0, atol=rel * condition * scale)
    np.testing.assert_allclose(target.averages[0], data["tracked_target"], rtol=0,
                               atol=rel * np.abs(data["tracked_target"]).max())
    error = np.linalg.norm(reconstructed - target.averages[0]) / np.linalg.norm(target.averages[0] - raw[-1])
    close(error, spec["reconstruction_vs_tracked_rel_err"], 1e-6)
    CHECKED.add(("trajectory", 0))


def _run(script, *args):
    result = subprocess.run([sys.executable, "-m", f"megdiffusion.scripts.{script}", *args], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def _flat(weights, names):
    return np.concatenate([np.asarray(weights[name], np.float64).reshape(-1) for name in names])


def test_a_run_tracking_two_profiles_rebuilds_a_third_as_a_run_tracking_it(tmp_path, tiny_images, tiny_model_flags):
    """Two runs of one seed, one tracking sigma_rel 0.05 and 0.10 with 16 snapshots each, one tracking 0.07: the same
    raw weights, and 0.07 rebuilt from the first run's snapshots is the second's tracked 0.07 to well within the
    goal's 1% (|rebuilt - tracked| / |tracked - raw|), and the float64 combination of the stored float32 snapshots
    to float32 rounding; the rebuilt file loads as a checkpoint of the run's network."""
    np.savez(tmp_path / "data.npz", tiny_images(32))
    common = ["--dataset=npz", f"--data_path={tmp_path / 'data.npz'}", *tiny_model_flags, "--num_timesteps=40",
              "--batch_size=8", "--total_steps=32", "--warmup_steps=0", "--lr=1e-3", "--sample_every=0",
              "--save_every=0", "--dropout=0"]
    pair, single = tmp_path / "pair", tmp_path / "single"
    started = _run("train", *common, f"--logdir={pair}", "--ema_profiles=0.05,0.10", "--snapshot_every=2")
    assert "post-hoc EMA: tracking sigma_rel 0.05, 0.1; a snapshot every 2 steps" in started.stderr
    _run("train", *common, f"--logdir={single}", "--ema_profiles=0.07")
    wrote = _run("posthoc_ema", str(pair), "--sigma_rel=0.07,0.2", f"--output={tmp_path / 'rebuilt'}")
    assert "sigma_rel 0.07 at step 32 (256 images) from 16 snapshots of sigma_rel 0.05, 0.1" in wrote.stdout
    assert "warning: sigma_rel 0.2 lies outside the tracked profiles' span (0.05 to 0.1)" in wrote.stderr

    a = ckpt.load_checkpoint(ckpt.list_checkpoints(str(pair))[-1])
    b = ckpt.load_checkpoint(ckpt.list_checkpoints(str(single))[-1])
    names = list(a["model"])
    raw = _flat(a["model"], names)
    np.testing.assert_array_equal(raw, _flat(b["model"], names))  # tracking changes nothing else
    rebuilt_state, path = ckpt.load_file_or_newest(str(tmp_path / "rebuilt" / "ema_0.070.pkl"))
    rebuilt, tracked = _flat(rebuilt_state["ema"], names), _flat(b["ema_profiles"][0], names)
    error = np.linalg.norm(rebuilt - tracked) / np.linalg.norm(tracked - raw)
    assert error < 0.01, error

    snapshots = [ckpt.load_snapshot(p) for _, p in ckpt.list_snapshots(str(pair))]
    profiles = [(snap["t"], s) for snap in snapshots for s in snap["sigma_rel"]]
    stored = np.array([_flat(w, names) for snap in snapshots for w in snap["profiles"]])
    weights, _ = ph.coefficients(profiles, (256, 0.07))
    rounding = np.finfo(np.float32).eps * np.abs(weights).sum() * np.abs(stored).max()
    np.testing.assert_allclose(rebuilt, weights @ stored, rtol=0, atol=rounding)

    from megdiffusion.training.config import build_model

    ckpt.load_weights(build_model(ckpt.config_of(rebuilt_state, path)), rebuilt_state["ema"], path)

    # The sweep: each rebuilt length sampled and scored, a table and a chart.
    swept = _run("fid", "--sweep", str(tmp_path / "rebuilt"), "--num_images=6", "--sampler=ddim", "--steps=2",
                 "--metrics=fid,kid", "--kid_subset_size=4", str(tmp_path / "data.npz"))
    lines = swept.stdout.splitlines()
    assert lines[0].startswith("sigma_rel 0.070: FID: ") and lines[1].startswith("sigma_rel 0.200: FID: ")
    assert lines[2].startswith("best sigma_rel 0.") and lines[2].endswith("sweep.png")
    table = json.loads((tmp_path / "rebuilt" / "sweep.json").read_text())
    assert table["tracked_sigma_rel"] == [0.05, 0.1] and [row["sigma_rel"] for row in table["rows"]] == [0.07, 0.2]
    assert all(np.isfinite(row["fid"]) and np.isfinite(row["kid"]) and row["step"] == 32 for row in table["rows"])
    from PIL import Image

    assert Image.open(tmp_path / "rebuilt" / "sweep.png").size == (640, 720)  # FID's panel, then KID's


@pytest.mark.parametrize("engine", ["numpy", "megengine"])
def test_training_tracks_each_profile_as_the_float64_tracker_of_its_weights(tiny_config, engine):
    """In the update of either engine: after step 1 a profile is the weights (beta 0), and after each step the
    float64 tracker of the weights after every step, to float32 rounding; the EMA is left as it was."""
    from megdiffusion.cpu import onednn
    from megdiffusion.training.trainer import Trainer
    from test_training import ema_numpy, params_numpy, toy_batch

    if engine == "numpy" and not onednn.available():
        pytest.skip("the numpy pass needs oneDNN")
    cfg = tiny_config(ema_profiles="0.05,0.2", lr=1e-3)
    trainer, plain = Trainer(cfg, engine=engine), Trainer(cfg.replace(ema_profiles=""), engine=engine)
    names = trainer.engine.param_names
    tracker = None
    for step in range(1, 7):
        trainer.step(toy_batch(seed=step))
        plain.step(toy_batch(seed=step))
        weights = np.concatenate([p.numpy().reshape(-1) for p in trainer.model.parameters()])
        tracker = tracker or ph.Tracker(weights, [0.05, 0.2])
        tracker.update(weights, step * cfg.batch_size, cfg.batch_size)
        profiles = [_flat(w, names) for w in trainer.engine.profile_weights()]
        if step == 1:
            for profile in profiles:
                np.testing.assert_array_equal(profile, weights)
        for profile, expected in zip(profiles, tracker.averages, strict=True):
            np.testing.assert_allclose(profile, expected, rtol=0, atol=4 * step * np.finfo(np.float32).eps
                                       * np.abs(expected).max())
    for a, b in zip(params_numpy(trainer.model) + ema_numpy(trainer), params_numpy(plain.model) + ema_numpy(plain)):
        np.testing.assert_array_equal(a, b)


def test_the_sweeps_chart_draws_the_curve_its_best_point_and_the_tracked_profiles():
    from megdiffusion.metrics.sweep import chart

    image = chart([0.03, 0.07, 0.15], [30.0, 20.0, 25.0], [0.05, 0.1], "FID", "FID").astype(int)
    assert image.shape == (360, 640, 3)
    red = (image[..., 0] > 150) & (image[..., 1] < 60) & (image[..., 2] < 60)
    orange = (image[..., 0] == 200) & (image[..., 1] == 120) & (image[..., 2] == 0)
    blue = (image[..., 0] == 0) & (image[..., 1] == 70) & (image[..., 2] == 160)
    assert red.sum() > 20 and orange.sum() > 100 and blue.sum() > 200
    best_column = np.nonzero(red.any(axis=0))[0].mean()
    tracked_columns = sorted({int(c) for c in np.nonzero(orange[100:200].any(axis=0))[0]})
    assert tracked_columns[0] < best_column < tracked_columns[-1]  # 0.07 lies between the tracked 0.05 and 0.10


def test_every_listed_case_was_checked():
    expected = {(kind, i) for kind in KINDS for i in range(len(CASES[kind]))} | {("trajectory", 0)}
    assert CHECKED == expected
