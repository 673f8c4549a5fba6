#!/usr/bin/env bash
# The demo: set up .venv, then train the CPU recipe on the embedded Fashion-MNIST for a time budget,
# sample with the EMA model, and score FID. Everything goes to runs/demo (or --output DIR).
#   scripts/demo.sh                 # 10 minutes of training (MINUTES=20 scripts/demo.sh for 20)
#   scripts/demo.sh --images 45000  # 45,000 training images, however long they take
#   scripts/demo.sh --resume        # train the previous demo model further, then score again
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m megdiffusion.scripts.demo ${MINUTES:+--minutes "$MINUTES"} "$@"
