#!/usr/bin/env bash
# usage: bash scripts/demo.sh [CONFIG (default configs/demo_diloco.toml)] [--section.key value ...]
# The main job on a fresh machine: install, fetch the demo corpus, train 2 DiLoCo sites x 2 FSDP
# ranks on this machine, export a Hugging Face model. Takes about 5 minutes on 2 CPU cores.
set -euo pipefail
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { awk 'NR > 1 && !/^#( |$)/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0; }  # the header above
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source "${ZEROBAND_VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
CONFIG="${1:-configs/demo_diloco.toml}"
shift || true

# Every cross-site message is authenticated and every checkpoint signed with the run's secret. With no
# ZEROBAND_SECRET of yours, `zeroband launch` makes one for the run and keeps it in
# runs/<name>/launch.secret (mode 0600), where a later `zeroband launch` (resume) and `zeroband export`
# of the same config read it again: everything the demo writes stays verifiable. The demo always trains
# afresh: each site moves a previous run's metrics, config and checkpoints together into
# runs/<name>/site<k>/old-<time>/ and keeps the newest checkpoint.keep_old of those (zeroband/rundir.py).
zeroband data                                              # corpus + tokenizer -> data/demo/
zeroband launch "$CONFIG" --sites 2 --nproc 2 --checkpoint.resume none "$@"   # 2 sites, each its own torchrun job
zeroband export "$CONFIG" "$@"                             # -> runs/<name>/hf (checked against transformers)
python - "$CONFIG" "$@" <<'PY'
import sys
from zeroband.config import load_config
from zeroband.tools.report import loss_table, read_metrics
cfg = load_config(sys.argv[1], sys.argv[2:] + ["--sites.site_rank", "0", "--sites.site_count", "2"])
series = {f"site{k}": read_metrics(cfg.run_dir / f"site{k}" / "metrics.jsonl") for k in range(2)}
print("\nLoss of each site (outer: the sites average here; val: the shared model after it):")
print(loss_table(series, every=2))
print(f"\nplot: {cfg.run_dir / 'loss.png'}   Hugging Face export: {cfg.run_dir / 'hf'}")
PY
