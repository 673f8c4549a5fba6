"""Training-time FID and the time limit, on a tiny run."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from megdiffusion.metrics import evaluate
from megdiffusion.compat import quiet_megengine
from megdiffusion.metrics import fid
from megdiffusion.training import checkpoint as ckpt
from megdiffusion.training.trainer import TrainingRun

quiet_megengine()


@pytest.fixture
def run(tiny_config, tiny_images):
    """``run(logdir, **changes)``: a 2-step tiny run that scores with 3 sampling steps; returns it."""
    def make(logdir, **changes):
        cfg = tiny_config(**{**dict(total_steps=2, sample_steps=3, logdir=str(logdir)), **changes})
        return TrainingRun(cfg, tiny_images(16), progress=False)

    return make


def test_fid_every_writes_fid_to_metrics_and_caches_the_reference(run, tmp_path, monkeypatch):
    training = run(tmp_path, fid_every=2, fid_num_images=4)
    training.run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if "fid" in r]
    assert [r["step"] for r in scored] == [2] and scored[0]["fid_num_images"] == 4
    assert np.isfinite(scored[0]["fid"]) and scored[0]["fid"] > 0
    cached = fid.load_statistics(tmp_path / "fid_reference.npz")
    assert cached.mu.shape == (2048,) and cached.sigma.shape == (2048, 2048) and cached.features is None

    # The cached reference is reused: computing it again would fail here.
    monkeypatch.setattr(fid, "statistics_of_images", lambda *a, **k: pytest.fail("recomputed"))
    again = evaluate.reference_statistics(training.loader.images, tmp_path / "fid_reference.npz")
    np.testing.assert_array_equal(again.sigma, cached.sigma)


def test_fid_cli_scores_a_checkpoint_like_the_training_hook(run, tmp_path):
    """KID and precision/recall too: the hook keeps the reference's features, which the fid script reads."""
    run(tmp_path, fid_every=2, fid_num_images=4, fid_metrics="all").run()
    during_training = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert fid.load_statistics(tmp_path / "fid_reference.npz").features.shape == (16, 2048)
    assert during_training["kid_subset_size"] == 4 and during_training["kid_subsets"] == 100
    assert 0 <= during_training["precision"] <= 1 and 0 <= during_training["recall"] <= 1
    result = subprocess.run([sys.executable, "-m", "megdiffusion.scripts.fid", f"--ckpt={tmp_path}",
                             "--num_images=4", "--sampler=ddim", "--steps=3", "--seed=0", "--noprogress",
                             "--metrics=fid,kid,pr", str(tmp_path / "fid_reference.npz")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    fid_line, kid_line, pr_line = result.stdout.splitlines()
    assert float(re.search(r"FID: ([0-9.]+) \(4 EMA samples", fid_line).group(1)) == pytest.approx(
        during_training["fid"], abs=1e-4)
    kid, kid_std = map(float, re.search(r"KID \(Inception-v3 pool3, 100 subsets of 4\): ([-0-9.]+) ± ([0-9.]+) x "
                                        r"1e-3 \(4 EMA samples", kid_line).groups())
    assert (kid, kid_std) == pytest.approx((during_training["kid"] * 1e3, during_training["kid_std"] * 1e3), abs=0.01)
    precision, recall = map(float, re.search(r"precision ([0-9.]+) recall ([0-9.]+) F [0-9.]+ \(Inception-v3 "
                                             r"pool3, k=3\) \(4 EMA samples", pr_line).groups())
    assert (precision, recall) == (during_training["precision"], during_training["recall"])


def test_time_limit_stops_early_with_a_checkpoint(run, tmp_path):
    reached = run(tmp_path, total_steps=100000, time_limit_minutes=0.5 / 60).run()
    assert 1 <= reached < 100000
    assert ckpt.list_checkpoints(str(tmp_path))[-1].endswith(f"ckpt_{reached:07d}.pkl")


def test_fid_cli_samples_a_solver_with_its_default_steps(run, tmp_path):
    """fid --ckpt --sampler euler without --steps: the solvers' default (20), as scripts.sample and the docs say."""
    run(tmp_path, fid_every=2, fid_num_images=4).run()
    result = subprocess.run([sys.executable, "-m", "megdiffusion.scripts.fid", f"--ckpt={tmp_path}",
                             "--num_images=4", "--sampler=euler", "--noprogress", str(tmp_path / "fid_reference.npz")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "step 2, euler-20 karras," in result.stdout, result.stdout
