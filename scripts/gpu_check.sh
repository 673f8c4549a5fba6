#!/usr/bin/env bash
# Checks for a machine with CUDA GPUs (6 minutes at most): the tests marked gpu (training and sampling
# through the spawn launcher), then a short 1-GPU training run
# through megengine.distributed.launcher on the embedded Fashion-MNIST, printing its images/s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_training.py tests/test_sample.py
logdir=$(mktemp -d)
trap 'rm -rf "$logdir"' EXIT
timeout 120 "$PY" - "$logdir" <<'PYEOF'
import json
import statistics
import sys

from megdiffusion.compat import quiet_megengine

quiet_megengine()
from megdiffusion.training.config import TrainConfig, resolve  # noqa: E402
from megdiffusion.training.trainer import train  # noqa: E402

cfg, images = resolve(TrainConfig(
    dataset="fashion_mnist", model_channels=64, channel_mult=(1, 2, 2), num_res_blocks=2,
    attention_resolutions=(7,), batch_size=128, total_steps=60, warmup_steps=10, log_every=1,
    sample_every=60, sample_num=16, sample_steps=10, logdir=sys.argv[1], device="gpu"))
train(cfg, images, progress=False, use_launcher=True)
with open(f"{sys.argv[1]}/metrics.jsonl") as f:
    metrics = [json.loads(line) for line in f]
speed = statistics.median(m["images_per_s"] for m in metrics[10:])
print(json.dumps({"check": "1-gpu launcher run", "steps": metrics[-1]["step"],
                  "final_loss": metrics[-1]["loss"], "images_per_s": round(speed, 1),
                  "batch_size": cfg.batch_size, "image_size": cfg.image_size}))
PYEOF
