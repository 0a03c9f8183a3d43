#!/usr/bin/env bash
# usage: bash scripts/test.sh [pytest arguments]
# Install (if needed) and run the lint and the test suite. CI (.ci/run) runs exactly this.
#   ZEROBAND_NO_APT=1   never call apt-get (the etcd tests then skip, and this says so)
set -euo pipefail
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { awk 'NR > 1 && !/^#( |$)/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0; }  # the header above
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${ZEROBAND_VENV:-.venv}"

# The etcd tests need Debian's etcd-server (a real 3-member cluster on loopback). Install it where
# we can (root with apt-get); otherwise say what will be skipped, here and again at the end.
SKIPPED=""
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${ZEROBAND_NO_APT:-}" ]; then
    echo "== installing etcd-server (for the etcd tests)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null) \
      || SKIPPED="apt-get install etcd-server failed"
  elif [ -n "${ZEROBAND_NO_APT:-}" ]; then
    SKIPPED="ZEROBAND_NO_APT is set"
  elif [ "$(id -u)" != 0 ]; then
    SKIPPED="not root"
  else
    SKIPPED="no apt-get"
  fi
fi
if [ -n "$SKIPPED" ]; then
  SKIPPED="SKIPPED: etcd-server is not installed ($SKIPPED), so the etcd store tests skip; CI runs them. Install it with: sudo apt-get install etcd-server"
  echo "== $SKIPPED"
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
status=0
"$VENV/bin/ruff" check . && "$VENV/bin/python" -m pytest "$@" || status=$?
[ -z "$SKIPPED" ] || echo "== $SKIPPED"
exit "$status"
