#!/usr/bin/env bash
# Install (if needed) and run the lint and the test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${ZEROBAND_VENV:-.venv}"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest "$@"
