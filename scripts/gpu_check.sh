#!/usr/bin/env bash
# Checks and measures the GPU path on the first machine with CUDA GPUs it meets (about 10 minutes at most):
#  1. the tests marked gpu (training and sampling through the spawn launcher) and the step options' tests
#     (tests/test_step_options.py: mixed precision, micro-batches, ranks, tracing), here on the GPU;
#  2. the DDPM paper's CIFAR-10 network at batch 128 (benchmarks/gpu_step.py): eager fp32, --trace (the whole step as
#     two compiled graphs: gradients and norm, then clip, Adam and EMA), --amp, --amp --trace, --microbatch 32, and the
#     training command on 1 GPU and, with two or more, on 2; each row with its host reads (synchronisations) per step
#     and, profiled, an eager step's kernels and Python dispatches or a traced step's graph operators.
# Step 2 prints one JSON line per row (docs/gpus.md: how to read them); paste them into an issue.
# Before them, a header: MegEngine's version, the CUDA and cuDNN it was built with, each card's name and compute
# capability; a build that does not target the card (no kernels for it: PTX JIT or nothing) is refused in one line,
# exit 2 (megdiffusion/scripts/gpu_build.py; GPU_CHECK_ALLOW_JIT=1 measures a PTX-JIT build anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ALLOW_JIT=""
if [ "${GPU_CHECK_ALLOW_JIT:-0}" = 1 ]; then ALLOW_JIT=--allow-jit; fi
"$PY" -m megdiffusion.scripts.gpu_build check $ALLOW_JIT
if ! "$PY" -c 'import megengine, sys; sys.exit(0 if megengine.is_cuda_available() else 1)' 2>/dev/null; then
    echo "gpu_check: MegEngine sees no CUDA GPU on this machine; run it where one is" >&2
    exit 2
fi
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_training.py tests/test_sample.py
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_step_options.py
ROWS=fp32,trace,amp,amp+trace,microbatch32,gpus1
if [ "$("$PY" -c 'import megengine; print(megengine.device.get_device_count("gpu"))' 2>/dev/null)" -ge 2 ]; then
    ROWS=$ROWS,gpus2
fi
timeout 600 "$PY" benchmarks/gpu_step.py --rows "$ROWS" --steps 20 --warmup 5 --profile
