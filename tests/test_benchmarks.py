"""Every script in benchmarks/ runs here at its smallest size, so that a benchmark calling something that is gone fails
the suite: a tiny real run where that takes seconds, else ``--help`` and the part that runs without torch or a long
run. ``SMOKE`` names each script's check (a test here, or one in another file that runs the script); a script without
one fails ``test_every_benchmark_has_a_smoke_run``. The checks assert what the scripts print, never their speed."""
import ast
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
HAS_TORCH = importlib.util.find_spec("torch") is not None
NO_TORCH = "no torch in"  # vs_pytorch.torch_python's message when neither --torch_python nor this python has torch

SMOKE = {}  # script -> the test that runs it: a function here, or "tests/FILE.py::TEST"
SMOKE["gpu_step.py"] = "tests/test_step_options.py::test_the_gpu_benchmark_runs_every_row_and_its_losses_agree"


def smoke(*scripts):
    """Register the decorated test as the smoke run of ``scripts``."""
    def register(test):
        SMOKE.update((script, test) for script in scripts)
        return test
    return register


def run(script, *args, returncode=0, env=None):
    """``benchmarks/<script> args`` in a fresh process of this python: the finished process, its exit code checked."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == returncode, done.stderr[-3000:]
    return done


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def load(script):
    """``benchmarks/<script>`` imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def without_torch_python():
    return {key: value for key, value in os.environ.items() if key != "MEGDIFFUSION_TORCH_PYTHON"}


@smoke("train_step.py")
def test_train_step():
    lines = json_lines(run("train_step.py", "--models", "cpu", "--paths", "native,fast,profiles",
                           "--rounds", "1",
                           "--steps", "1", "--cpu_batch", "2").stdout)
    assert [(line["path"], line["batch"]) for line in lines[:-1]] == [("native", 2), ("fast", 2), ("profiles", 2)]
    assert lines[-1]["summary"] and lines[-1]["ratio"] > 0 and lines[-1]["image_size"] == 28
    # a figure, not a bound: one step of each path on a shared machine differs by more than the profiles' cost
    assert math.isfinite(lines[-1]["profiles_cost"]) and math.isfinite(lines[-1]["profiles_cpu_cost"])


@smoke("sample.py")
def test_sample():
    lines = json_lines(run("sample.py", "--batch_size", "2", "--repeats", "1", "--samplers", "ddim-2,ddpm-3").stdout)
    assert [line.get("mode") for line in lines[:2]] == ["eager", "traced"] and lines[2]["traced_speedup"] > 0
    assert [line["sampler"] for line in lines[3:]] == ["ddim-2", "ddpm-3"]
    assert all(line["seconds_per_image"] > 0 for line in lines[3:])
    (job,) = json_lines(run("sample.py", "--job", "4", "--batch_size", "2", "--samplers", "ddim-2", "--rounds",
                            "1").stdout)
    assert job["images"] == 4 and job["once_per_job_s"] > 0 and job["speedup"] > 0


@smoke("export.py")
def test_export():
    lines = json_lines(run("export.py", "--models", "cpu_recipe_classes", "--batches", "1,2", "--repeats", "1").stdout)
    assert [(line["batch"], line["runtime"]) for line in lines[:-1]] == [
        (batch, runtime) for batch in (1, 2) for runtime in ("eager", "mge", "onnx")]
    assert all(line["relative_diff"] <= 1e-4 and line["ms_per_forward"] > 0 for line in lines[:-1])
    assert set(lines[-1]["bytes"]) == {"checkpoint", "onnx", "mge_b1", "mge_b2"}


@smoke("fid_features.py")
def test_fid_features():
    lines = json_lines(run("fid_features.py", "--batch_sizes", "1", "--repeats", "1", "--routes",
                           "numpy,megengine").stdout)
    assert [(line["route"], line["batch_size"]) for line in lines] == [("numpy", 1), ("megengine", 1)]
    assert all(line["images_per_s"] > 0 for line in lines)


@smoke("numpy_pass.py")
def test_numpy_pass():
    done = run("numpy_pass.py", "--model", "cifar", "--group", "1", "--repeats", "1", "--profile")
    lines = json_lines(done.stdout)
    assert [(line["pass"], line["group"]) for line in lines] == [("train", 1), ("eval", 1)]
    assert "# train pass, 1 repeats" in done.stdout and "# eval pass, 1 repeats" in done.stdout


@smoke("stress.py")
def test_stress():
    """One run with a sampling call after every step; a run stops after its budget, and its first step runs
    whatever the budget, so the counts hold on any machine."""
    lines = json_lines(run("stress.py", "--minutes", "0.01", "--runs", "1", "--sample_every", "1",
                           "--sample_batch", "2", "--sample_steps", "1").stdout)
    assert lines[0]["error"] is None and lines[0]["steps"] >= 1 and lines[0]["sample_calls"] == lines[0]["steps"]
    assert lines[-1]["summary"] and lines[-1]["runs"] == 1 and lines[-1]["failed"] == 0


@smoke("vs_pytorch.py", "megdiffusion_side.py", "measurement.py")
def test_vs_pytorch(tmp_path):
    """megdiffusion's side through its commands (``measurement.py`` times it); the whole comparison at its smallest
    where this python has torch, else its one-line refusal."""
    work = tmp_path / "work"
    run("megdiffusion_side.py", "prepare", work, "--models", "cpu,cifar", "--cpu_batch", "2", "--cifar_batch", "1")
    assert {path.name for path in work.iterdir()} == {f"{m}{suffix}" for m in ("cpu", "cifar")
                                                       for suffix in (".json", "_x0.npy", "_weights.npz")}
    (line,) = json_lines(run("megdiffusion_side.py", "train", work, "cpu", "--warmup", "0", "--steps", "1").stdout)
    assert (line["side"], line["mode"], line["images"]) == ("megdiffusion", "train", 2) and line["loss"] > 0
    (line,) = json_lines(run("megdiffusion_side.py", "ddim", work, "cifar", "--batch", "1", "--sample_steps", "3",
                             "--sampler", "heun").stdout)
    assert (line["sampler"], line["sample_steps"], line["images"]) == ("heun", 3, 1)
    assert "--torch_python" in run("vs_pytorch.py", "--help").stdout
    if HAS_TORCH:
        lines = json_lines(run("vs_pytorch.py", "--models", "cpu", "--rounds", "1", "--steps", "1", "--warmup", "0",
                               "--cpu_batch", "2", "--no_check").stdout)
        assert lines[-1]["summary"] and lines[-1]["ratio"] > 0
    else:
        done = run("vs_pytorch.py", "--models", "cpu", "--rounds", "1", returncode=1, env=without_torch_python())
        assert NO_TORCH in done.stderr and "--torch_python" in done.stderr


@smoke("pytorch_twin.py")
def test_pytorch_twin():
    """The twin imports torch first of all it needs beyond numpy and the standard library: without torch, the file
    compiles and stops there; with torch, its commands are listed (tests/test_vs_pytorch.py checks it then)."""
    if HAS_TORCH:
        assert "check" in run("pytorch_twin.py", "--help").stdout
    else:
        done = run("pytorch_twin.py", "--help", returncode=1)
        assert done.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'torch'"


@smoke("inception_vs_pytorch.py")
def test_inception_vs_pytorch(tmp_path):
    """megdiffusion's side of one image, and the comparison (with torch) or its one-line refusal (without)."""
    from megdiffusion.metrics.fid import preprocess

    np.save(tmp_path / "input.npy", preprocess(np.zeros((1, 32, 32, 3), np.uint8)))
    (line,) = json_lines(run("inception_vs_pytorch.py", "side", "megdiffusion", tmp_path / "input.npy",
                             tmp_path / "features.npy", "--batches", "1").stdout)
    assert (line["side"], line["batch"], line["images"]) == ("megdiffusion", 1, 1)
    assert np.load(tmp_path / "features.npy").shape == (1, 2048)
    args = ["--batch_size", "1", "--rounds", "1", "--batches", "1"]
    if HAS_TORCH:
        assert json_lines(run("inception_vs_pytorch.py", *args).stdout)[-1]["summary"]
    else:
        done = run("inception_vs_pytorch.py", *args, returncode=1, env=without_torch_python())
        assert done.stderr.startswith(f"error: {NO_TORCH}")


@smoke("fid_vs_calls.py")
def test_fid_vs_calls(tmp_path, tiny_config, tiny_images):
    """One point of the curve on a tiny run (2 samples instead of the demo's 500): the sampler's steps for its calls,
    the guide, the FID against the run's reference statistics."""
    from megdiffusion.metrics import fid
    from megdiffusion.training.trainer import TrainingRun

    assert "SAMPLER:SPACING:CALLS" in run("fid_vs_calls.py", "--help").stdout
    benchmark = load("fid_vs_calls.py")
    assert [benchmark.steps_for("heun", 6, True), benchmark.steps_for("ddim", 7, False)] == [2, 7]
    with pytest.raises(ValueError, match="even number of calls"):
        benchmark.steps_for("ddim", 7, True)
    run_dir = tmp_path / "demo"
    TrainingRun(tiny_config(total_steps=1, logdir=str(run_dir / "train")), tiny_images(16), progress=False).run()
    shutil.copy(next((run_dir / "train" / "checkpoints").iterdir()), run_dir / "guide.pkl")
    (run_dir / "reference").mkdir()
    features = np.random.default_rng(0).standard_normal((4, 2048))
    fid.save_statistics(run_dir / "reference" / "fashion_mnist_first1000.npz", fid.statistics_of_features(features))
    point = benchmark.measure(str(run_dir), "heun", "default", 6, True, num_images=2, batch_size=2)
    assert point["steps"] == 2 and point["train_step"] == 1 and np.isfinite(point["fid"])


@smoke("step_feed.py")
def test_step_feed():
    """End to end on a small set: the rows it prints, with workers and without."""
    done = run("step_feed.py", "--recipes", "cifar", "--workers", "0,1", "--steps", "2", "--warmup", "1", "--images",
               "256", "--step_ms", "1")
    assert "| cifar (32x32) | 128 | 0 |" in done.stdout and "| cifar (32x32) | 128 | 1 |" in done.stdout


def test_every_benchmark_has_a_smoke_run():
    scripts = sorted(path.name for path in BENCHMARKS.glob("*.py"))
    assert sorted(SMOKE) == scripts, f"without a smoke run here: {sorted(set(scripts) - set(SMOKE))}"
    for script, test in SMOKE.items():
        if isinstance(test, str):  # a test in another file: it exists and runs the script
            path, _, name = test.partition("::")
            tree = ast.parse((ROOT / path).read_text())
            (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
            assert script in ast.get_source_segment((ROOT / path).read_text(), function), test
