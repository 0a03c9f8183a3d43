#!/usr/bin/env bash
# usage: bash scripts/test.sh [pytest arguments]
# Install (if needed) and run the lint, the type checker (mypy, configured in pyproject.toml) and the
# test suite. CI (.ci/run) runs exactly this.
#   ZEROBAND_NO_APT=1   never call apt-get (the etcd, SLURM and Docker tests then skip, and this says so)
set -euo pipefail
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { awk 'NR > 1 && !/^#( |$)/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0; }  # the header above
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${ZEROBAND_VENV:-.venv}"

# Some tests need Debian packages: a real 3-member etcd cluster on loopback (etcd-server), a real
# SLURM cluster for the sbatch script (slurm-wlm, munge), a Docker engine and a Debian base image for
# docker/Dockerfile (docker.io, debootstrap). Install what is missing where we can (root with
# apt-get), once; otherwise say what will be skipped, here and again at the end.
declare -A NEEDS=([etcd]="etcd-server" [slurmctld]="slurm-wlm" [slurmd]="slurm-wlm" [munged]="munge"
                  [dockerd]="docker.io" [debootstrap]="debootstrap")
MISSING=""
for bin in "${!NEEDS[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || MISSING="$MISSING ${NEEDS[$bin]}"
done
MISSING=$(echo "$MISSING" | tr ' ' '\n' | sort -u | xargs)
SKIPPED=""
if [ -n "$MISSING" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${ZEROBAND_NO_APT:-}" ]; then
    echo "== installing $MISSING (for the etcd, SLURM and Docker tests)"
    # shellcheck disable=SC2086  # one word per package
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $MISSING >/dev/null) \
      || SKIPPED="apt-get install $MISSING failed"
  elif [ -n "${ZEROBAND_NO_APT:-}" ]; then
    SKIPPED="ZEROBAND_NO_APT is set"
  elif [ "$(id -u)" != 0 ]; then
    SKIPPED="not root"
  else
    SKIPPED="no apt-get"
  fi
fi
if [ -n "$SKIPPED" ]; then
  SKIPPED="SKIPPED: $MISSING not installed ($SKIPPED), so the tests that need them skip; CI runs them. Install with: sudo apt-get install $MISSING"
  echo "== $SKIPPED"
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
# The tree's bytecode, once (into its gitignored __pycache__ folders): where PYTHONDONTWRITEBYTECODE is set,
# as in CI's containers, each of the hundreds of processes the tests start (launchers, torchrun agents and
# ranks, stores) would otherwise compile every module it imports from source again, ~1 s of CPU each.
"$VENV/bin/python" -m compileall -q -j 0 zeroband scripts tests >/dev/null || true
# Two phases: every test but the `serial` ones on ZEROBAND_TEST_WORKERS processes (pytest-xdist; most
# tests wait on child processes and sockets, so 2 workers finish in about half the time on 2 cores),
# then the `serial` ones (they time the emulated link) alone. Exit 5 (nothing selected) in one phase is
# fine when the other ran tests: `-m unit` selects no serial test. Pass -n yourself for one plain run.
pytest_phases() {
  local a b
  if [[ " $* " == *" -n "* ]] || ! "$VENV/bin/python" -c "import xdist" 2>/dev/null; then
    "$VENV/bin/python" -m pytest "$@"; return
  fi
  ZEROBAND_TESTS=parallel "$VENV/bin/python" -m pytest -n "${ZEROBAND_TEST_WORKERS:-2}" "$@" && a=0 || a=$?
  ZEROBAND_TESTS=serial "$VENV/bin/python" -m pytest "$@" && b=0 || b=$?
  if [ "$a" = 5 ] && [ "$b" = 5 ]; then return 5; fi
  for rc in "$a" "$b"; do [ "$rc" = 0 ] || [ "$rc" = 5 ] || return "$rc"; done
}
status=0
"$VENV/bin/ruff" check . && "$VENV/bin/mypy" && pytest_phases "$@" || status=$?
[ -z "$SKIPPED" ] || echo "== $SKIPPED"
exit "$status"
