"""benchmarks/data_scale.py without running it (it generates thousands of images and trains): its --help, its flags,
and the row it prints instead of the old code's run where the in-RAM array would not fit."""
import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "data_scale.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("data_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # numpy and the standard library only: no MegEngine
    return module


def test_help_exits_0_and_lists_the_flags():
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    for flag in ("--sizes", "--quick", "--workdir", "--baseline", "--gpu_steps_per_s", "--data_workers"):
        assert flag in run.stdout


def test_flags_resolve_to_the_issue_sizes_and_quick_sizes():
    benchmark = load_benchmark()
    full = benchmark.parse_args([])
    assert full.sizes == [10000, 40000, 126227] and full.baseline == 1000
    quick = benchmark.parse_args(["--quick"])
    assert quick.sizes == [300, 600] and quick.baseline == 300


def test_the_old_code_is_not_run_where_its_array_would_not_fit(capsys):
    benchmark = load_benchmark()
    ram = 24 * 2 ** 30
    assert benchmark.cannot_fit(10000, ram) is None  # 1.97 GB
    line = benchmark.cannot_fit(126227, ram)
    assert line["skipped"].startswith("cannot fit: 126,227 images x 196,608 bytes = 24.8 GB >")
    assert '"skipped"' in capsys.readouterr().out  # printed as a JSON line


def test_step_feed_benchmark_runs_at_its_smallest_size():
    """benchmarks/step_feed.py end to end on a small set: the rows it prints, with workers and without."""
    script = SCRIPT.parent / "step_feed.py"
    run = subprocess.run([sys.executable, str(script), "--recipes", "cifar", "--workers", "0,1", "--steps", "2",
                          "--warmup", "1", "--images", "256", "--step_ms", "1"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "| cifar (32x32) | 128 | 0 |" in run.stdout and "| cifar (32x32) | 128 | 1 |" in run.stdout
