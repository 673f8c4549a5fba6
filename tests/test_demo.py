"""The demo pipeline end to end with a tiny budget: train, sample, grids, FID, summary; resume or restart."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megdiffusion.training.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[1]  # the code under test, not an installed copy (the demo runs elsewhere)


def run_demo(output, home, *extra, budget=("--minutes=0.02",)):
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), PYTHONPATH=str(REPO))
    args = [sys.executable, "-m", "megdiffusion.scripts.demo", *budget, "--num_images=4",
            "--num_reference=6", "--steps=2", "--batch_size=4", "--sweep_images=0", "--snapshot_every=1",
            f"--output={output}", *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=home)


def test_demo_trains_samples_scores_and_resumes(tmp_path):
    home, output = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    first = run_demo(output, home, "--sweep_images=4")  # the later runs score only the EMA the recipe trains
    assert first.returncode == 0, first.stderr
    summary = json.loads((output / "summary.json").read_text())
    assert summary["steps"] >= 1 and summary["steps_this_run"] == summary["steps"]
    assert np.isfinite(summary["fid"]) and summary["fid"] > 0 and summary["fid_num_images"] == 4
    assert 0 < summary["fid_floor"] < summary["fid"]  # 4 real images are closer to the data than 4 barely trained
    assert summary["sampler"] == "ddpm-2"  # the demo's protocol unless --sampler says otherwise
    # Guided by the model 40% of the way through the training (saved as guide.pkl).
    assert summary["guidance"] == 2.5 and 0 <= summary["guide_step"] <= summary["steps"]
    assert f"guided by the step-{summary['guide_step']} model with w=2.5" in first.stdout
    assert summary["guide_unconditional"] is False  # an unconditional recipe
    assert load_checkpoint(str(output / "guide.pkl"))["step"] == summary["guide_step"]
    assert summary["verdict"] == "still far from the data; train longer with --resume"
    assert (f"FID {summary['fid']:.2f} (real-data floor {summary['fid_floor']:.1f} in this protocol): still far from "
            "the data; train longer with --resume") in first.stdout
    # KID and precision/recall beside their floors, on 4 samples: subsets of 4, precision and recall in quarters
    assert summary["kid_subset_size"] == 4 and summary["kid_subsets"] == 100
    assert summary["kid"] > summary["kid_floor"] and summary["kid_std"] >= 0
    for name in ("precision", "recall", "precision_floor", "recall_floor"):
        assert summary[name] in (0, 0.25, 0.5, 0.75, 1)
    assert (f"demo: KID {summary['kid'] * 1e3:.2f} ± {summary['kid_std'] * 1e3:.2f} x 1e-3 (floor "
            f"{summary['kid_floor'] * 1e3:.2f} ± {summary['kid_std_floor'] * 1e3:.2f}), precision "
            f"{summary['precision']:.2f} (floor {summary['precision_floor']:.2f}), recall {summary['recall']:.2f} "
            f"(floor {summary['recall_floor']:.2f}); Inception-v3 pool3 features, KID on 100 subsets of 4, "
            "precision/recall with k=3") in first.stdout
    assert sorted(os.listdir(output / "reference")) == ["fashion_mnist_first6.npz", "fashion_mnist_last4.npz"]
    samples = np.load(output / "samples.npz")["arr_0"]
    assert samples.shape == (4, 28, 28, 1) and samples.dtype == np.uint8
    assert Image.open(output / "real.png").size == (2 + 8 * 30, 2 + 8 * 30)  # 8x8 real images, 2px gaps
    assert Image.open(output / "samples.png").size == (2 + 8 * 30, 32)  # the 4 samples: one row of 8 slots
    assert list(home.iterdir()) == []  # nothing written outside --output, caches included
    # The EMA chosen after training: the recipe's, or a length rebuilt from the tracked profiles' snapshots
    choice = summary["ema_choice"]
    assert choice["tracked_sigma_rel"] == [0.1, 0.2] and choice["sweep_images"] == 4
    assert list(choice["fid_by_ema"]) == ["recipe's EMA", "sigma_rel 0.1", "sigma_rel 0.15", "sigma_rel 0.2",
                                          "sigma_rel 0.25"]
    assert choice["chosen"] == min(choice["fid_by_ema"], key=choice["fid_by_ema"].get)
    assert f"EMA {choice['chosen']}, chosen by FID on 4 samples of another seed" in first.stdout
    assert json.loads((output / "demo.json").read_text())["ema_choice"] == choice
    sweep = json.loads((output / "posthoc" / "sweep.json").read_text())
    assert [row["sigma_rel"] for row in sweep["rows"]] == [0.1, 0.15, 0.2, 0.25]
    assert [row["fid"] for row in sweep["rows"]] == list(choice["fid_by_ema"].values())[1:]
    assert Image.open(output / "posthoc" / "sweep.png").size == (640, 360)

    resumed = run_demo(output, home, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    after = json.loads((output / "summary.json").read_text())
    assert after["steps"] == summary["steps"] + after["steps_this_run"] > summary["steps"]
    assert after["ema_choice"] is None and load_checkpoint(str(output / "train" / "checkpoints" / sorted(os.listdir(
        output / "train" / "checkpoints"))[-1]))["config"]["ema_profiles"] == "0.10,0.20"  # still tracked

    # An image budget: 70 images at the recipe's batch of 16 are five steps, on top of the resumed ones. The guide is
    # the checkpoint 40% of the way to the final step, or, when the runs before have passed that point, their guide.
    by_images = run_demo(output, home, "--resume", budget=("--images=70",))
    assert by_images.returncode == 0, by_images.stderr
    imaged = json.loads((output / "summary.json").read_text())
    start = after["steps"]
    assert imaged["steps"] == start + 5
    point = 0.4 * (start + 5)
    assert imaged["guide_step"] == (after["guide_step"] if point <= start else int(point))

    restarted = run_demo(output, home, "--sampler=ddim", "--guidance=1")
    assert restarted.returncode == 0, restarted.stderr
    again = json.loads((output / "summary.json").read_text())
    assert again["steps_this_run"] == again["steps"] and again["sampler"] == "ddim-2" and again["guidance"] == 1
    assert again["guide_step"] is None and again["guide_unconditional"] is False  # no guide loaded when unguided
    assert "guided" not in restarted.stdout


def test_demo_guides_a_run_trained_with_class_dropout_without_a_class(tmp_path):
    """A class-conditional recipe with --class_dropout: the guide predicts without a class (said in the summary and
    the protocol line), and the sample grid has a column per class."""
    home, output = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    config = tmp_path / "cfg.cfg"
    recipe = REPO / "configs" / "fashion_mnist_cpu.cfg"
    config.write_text(f"--flagfile={recipe}\n--num_classes=10\n--class_dropout=0.2\n")
    result = run_demo(output, home, f"--config={config}")
    assert result.returncode == 0, result.stderr
    summary = json.loads((output / "summary.json").read_text())
    assert summary["guide_unconditional"] is True
    assert f"guided by the step-{summary['guide_step']} unconditional model with w=2.5" in result.stdout
    assert Image.open(output / "samples.png").size == (2 + 10 * 30, 32)  # 4 samples in a row of 10 classes


def test_demo_refuses_a_directory_it_did_not_make(tmp_path):
    home, output = tmp_path / "home", tmp_path / "precious"
    home.mkdir()
    output.mkdir()
    (output / "thesis.tex").write_text("keep")
    result = run_demo(output, home)
    assert result.returncode == 2 and result.stderr.strip().startswith("error:")
    assert os.listdir(output) == ["thesis.tex"]


def test_demo_checks_the_sampler_before_training(tmp_path):
    home, output = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    result = run_demo(output, home, "--steps=1001")  # the recipe's T is 1000
    assert result.returncode == 2 and "steps must be an integer between 1 and T=1000" in result.stderr
    assert not (output / "train").exists()


def test_demo_refuses_floor_images_that_overlap_the_reference(tmp_path):
    home, output = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    result = run_demo(output, home, "--num_images=6000", "--num_reference=5000")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: --num_images 6000 + --num_reference 5000 is more than the 10000 training images: the floor's real "
        "images must be apart from the reference"]
    assert not output.exists()


def test_the_guide_sits_40_percent_of_the_way_to_the_final_step():
    from megdiffusion.scripts.demo import guide_fraction

    assert guide_fraction(0, 2813) == 0.4
    fraction = guide_fraction(1000, 4000)  # final step 5000: the guide at 2000, 1000 steps into this run
    assert 1000 + fraction * 4000 == pytest.approx(2000)
    assert guide_fraction(1407, 1406) == 0  # 40% of 2813 (1125) was passed before: the earlier run's guide stays


def test_verdict_is_close_within_one_and_a_half_floors():
    from megdiffusion.scripts.demo import verdict

    assert verdict(49.5, 33.0) == verdict(33.0, 33.0) == "samples close to the data"
    assert verdict(49.6, 33.0) == "still far from the data; train longer with --resume"


def test_ctrl_c_during_training_saves_a_checkpoint_and_stops_the_whole_demo(tmp_path):
    home, output = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), PYTHONPATH=str(REPO))
    demo = subprocess.Popen([sys.executable, "-m", "megdiffusion.scripts.demo", "--minutes=5", "--num_images=4",
                             "--num_reference=6", "--steps=2", "--batch_size=4", f"--output={output}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=home)
    deadline = time.time() + 120
    while not (output / "train" / "metrics.jsonl").is_file():  # opened once the signal handlers are in place
        assert demo.poll() is None and time.time() < deadline, demo.stderr.read() if demo.poll() else "timeout"
        time.sleep(0.2)
    demo.send_signal(signal.SIGINT)
    _, stderr = demo.communicate(timeout=120)
    assert demo.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: stopped by SIGINT at step ") and last.endswith("continue with --resume")
    assert len(os.listdir(output / "train" / "checkpoints")) == 1
    assert sorted(os.listdir(output)) == ["demo.json", "train"]  # no reference statistics, samples or summary


def test_demo_takes_one_training_budget(tmp_path):
    home, output = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    result = run_demo(output, home, budget=("--minutes=1", "--images=100"))
    assert result.returncode == 2 and "give --minutes or --images, not both" in result.stderr
    assert not output.exists()


def test_an_image_budget_of_one_batch_trains_its_guide_and_its_step(tmp_path):
    """--images 16 at the recipe's batch of 16 is one step: the guide is that step (its first part once ran zero
    steps and failed after writing the run)."""
    home, output = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    result = run_demo(output, home, budget=("--images=16",))
    assert result.returncode == 0, result.stderr
    summary = json.loads((output / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["guide_step"] == 1
