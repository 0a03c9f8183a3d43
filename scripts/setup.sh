#!/usr/bin/env bash
# usage: bash scripts/setup.sh
# Create (or reuse) the project's virtualenv and install zeroband into it.
#   ZEROBAND_VENV   where the venv lives (default: .venv in the checkout)
#   ZEROBAND_TORCH  the torch requirement (default: torch==2.13.0, the CPU build on this kind of
#                   machine). On GPU machines use e.g. ZEROBAND_TORCH="torch==2.13.0" with
#                   PIP_INDEX_URL pointing at the CUDA wheels, or install torch first yourself.
set -euo pipefail
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { awk 'NR > 1 && !/^#( |$)/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0; }  # the header above
cd "$(dirname "$0")/.."
VENV="${ZEROBAND_VENV:-.venv}"
TORCH="${ZEROBAND_TORCH:-torch==2.13.0}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
# torch first: an unpinned torch (pulled in by another package) would be a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "== installing $TORCH"
  "$VENV/bin/pip" install -q "$TORCH"
fi
if ! "$VENV/bin/python" -c "import zeroband, pytest, matplotlib, mypy" 2>/dev/null || [ pyproject.toml -nt "$VENV/.zeroband-installed" ]; then
  echo "== installing zeroband and its dependencies"
  "$VENV/bin/pip" install -q -e ".[dev]"
  touch "$VENV/.zeroband-installed"
fi
echo "== environment ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
