#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the linter, the type checker (pyproject.toml:
# strict on core/, check/, engine/, worker/, models/, checkpoint/) and the whole test suite on
# the CPU.
# One torch thread: tests share a 2-core machine, and torch spinning on 2 threads while
# another process is busy can run tens of times slower.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false SLOTSERVE_CHECK=1
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -p no:cacheprovider "$@"
