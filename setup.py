"""Packaging for megdiffusion: DDPM training, sampling and FID on MegEngine."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "megdiffusion" / "__init__.py").read_text()).group(1)

setup(
    name="megdiffusion",
    version=VERSION,
    description="Denoising diffusion (DDPM/DDIM) training, sampling and FID on MegEngine",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["megdiffusion", "megdiffusion.*"]),
    # The configs and the embedded Fashion-MNIST split travel inside the package,
    # so `pip install` users can train and score with no download.
    package_data={"megdiffusion": ["configs/*.cfg", "data/assets/*.gz"]},
    include_package_data=True,
    # numba 0.61.2 and llvmlite 0.44 (below) start at CPython 3.10; MegEngine's wheels (1.13) stop at 3.10.
    python_requires=">=3.10,<3.11",
    # oneDNN's JIT convolutions for CPU training (megdiffusion.cpu.onednn); elsewhere the numpy kernels run.
    # safetensors: scripts.export's diffusers weights.
    install_requires=["megengine>=1.9", "numpy<2", "absl-py", "tqdm", "pillow", "threadpoolctl>=3", "safetensors",
                      "onednn-cpu-gomp==2023.2.0; sys_platform == 'linux' and platform_machine == 'x86_64'",
                      # The numpy pass's GroupNorm, SiLU and softmax kernels (megdiffusion.cpu.fused); without it the
                      # numpy layers run.
                      "numba==0.61.2", "llvmlite==0.44.0"],
    extras_require={
        "dev": ["pytest", "pytest-xdist==3.8.0", "scipy", "wheel", "ruff>=0.17,<0.18", "lmdb", "onnx==1.17.0",
                "onnxruntime==1.20.1"],
        # scripts.export --to onnx, at the version its graphs were checked with (tests: onnxruntime 1.20.1).
        "onnx": ["onnx==1.17.0"],
        # scripts.prepare reads LSUN's LMDB with it.
        "lmdb": ["lmdb"],
        "tensorboard": ["tensorboardX"],
        # benchmarks/vs_pytorch.py's PyTorch twin only; megdiffusion never imports torch.
        "bench": ["torch"],
        # benchmarks/fid_vs_calls.py --plot (docs/fid_vs_calls.png) only.
        "docs": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "megdiffusion-train=megdiffusion.scripts.train:run",
            "megdiffusion-sample=megdiffusion.scripts.sample:run",
            "megdiffusion-fid=megdiffusion.scripts.fid:run",
            "megdiffusion-demo=megdiffusion.scripts.demo:run",
            "megdiffusion-convert=megdiffusion.scripts.convert:run",
            "megdiffusion-nll=megdiffusion.scripts.nll:run",
            "megdiffusion-prepare=megdiffusion.scripts.prepare:run",
            "megdiffusion-export=megdiffusion.scripts.export:run",
            "megdiffusion-posthoc-ema=megdiffusion.scripts.posthoc_ema:run",
        ]
    },
)
