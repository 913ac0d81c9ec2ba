#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the linter, the type checker (pyproject.toml:
# strict on core/, check/, engine/, worker/, models/, checkpoint/) and the whole test suite on
# the CPU.
# One torch thread per test process: tests share a 2-core machine, and torch spinning on 2
# threads while another process is busy can run tens of times slower. With no arguments the
# suite runs on SLOTSERVE_TEST_WORKERS processes (default 2, pytest-xdist, idle workers steal
# queued tests), then the `serial` tests alone: they measure the process tree against the
# machine (library pages another process maps stay resident). Arguments go to one plain
# pytest run instead (e.g. `bash scripts/test.sh tests/core -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false SLOTSERVE_CHECK=1
.venv/bin/ruff check .
.venv/bin/mypy
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
fi
.venv/bin/python -m pytest -p no:cacheprovider -n "${SLOTSERVE_TEST_WORKERS:-2}" \
  --dist worksteal -m "not serial" --durations=15
# Only the files that hold serial tests are imported: collecting the whole suite imports torch
# into pytest's own process, and pages it maps stay resident in the children too.
.venv/bin/python -m pytest -p no:cacheprovider -m serial $(grep -rl "pytest.mark.serial" tests)
