"""The wheel carries everything a `pip install` user needs: scripts, configs and the embedded data."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (path,) = out.glob("megdiffusion-*.whl")
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def test_wheel_contains_scripts_configs_and_data(wheel):
    for module in ("train", "sample", "fid", "convert", "nll"):
        assert f"megdiffusion/scripts/{module}.py" in wheel
    for config in ("cifar10", "celebahq256", "lsun_church256", "fashion_mnist_cpu", "iddpm_cifar10"):
        assert f"megdiffusion/configs/{config}.cfg" in wheel
    embedded = ROOT / "megdiffusion/data/assets/t10k-images-idx3-ubyte.gz"
    assert wheel["megdiffusion/data/assets/t10k-images-idx3-ubyte.gz"] == embedded.read_bytes()
    for package in ("nn", "diffusion", "data", "training", "metrics", "scripts"):
        assert f"megdiffusion/{package}/__init__.py" in wheel


def test_wheel_declares_entry_points_and_dependencies(wheel):
    dist_info = next(name.split("/")[0] for name in wheel if name.endswith(".dist-info/METADATA"))
    entry_points = wheel[f"{dist_info}/entry_points.txt"].decode()
    metadata = wheel[f"{dist_info}/METADATA"].decode()
    for name in ("train", "sample", "fid", "convert", "nll"):
        assert f"megdiffusion-{name} = megdiffusion.scripts.{name}:run" in entry_points
    for requirement in ("megengine>=1.9", "numpy<2", "absl-py", "tqdm", "pillow"):
        assert f"Requires-Dist: {requirement}" in metadata
    assert "Requires-Python: >=3.8,<3.11" in metadata
    # torch is only the bench extra (benchmarks/vs_pytorch.py), never a requirement of the package.
    torch_lines = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_lines == ['Requires-Dist: torch; extra == "bench"']


@pytest.mark.parametrize("script, flag", [("train", "--batch_size"), ("sample", "--sampler"),
                                          ("fid", "--save_stats"), ("demo", "--minutes"), ("convert", "--ema"),
                                          ("nll", "--respacing"), ("convert", "<auto|diffusers|pesser|pytorch_ddpm|"
                                                                   "megengine_port|improved_diffusion>")])
def test_scripts_print_their_flags(script, flag):
    result = subprocess.run([sys.executable, "-m", f"megdiffusion.scripts.{script}", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert flag in result.stdout, result.stderr  # (absl exits with 1 after --help)
