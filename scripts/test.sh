#!/usr/bin/env bash
# Set up the environment if needed, lint (ruff, settings in ruff.toml), then run the test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# One worker per core (pytest-xdist), each test file on one worker: files keep module-level state (the conformance
# tests' record of what they checked), and the suite's subprocess-heavy files run beside the others.
exec .venv/bin/python -m pytest -n auto --dist loadfile "$@"
