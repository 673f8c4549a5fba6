#!/usr/bin/env bash
# Set up the environment if needed, lint (ruff, settings in ruff.toml), then run the test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
