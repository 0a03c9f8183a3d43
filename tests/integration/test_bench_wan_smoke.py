"""scripts/bench_wan.py --quick: two real 2-site runs behind an emulated link write complete, sane results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
DATA = REPO / "data" / "demo"


def _unusable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices, tc)"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` unavailable"
    if not (DATA / "train.jsonl").is_file() or not (DATA / "tokenizer").is_dir():
        return "demo corpus missing: run `zeroband data`"
    return None


pytestmark = [pytest.mark.skipif(_unusable() is not None, reason=str(_unusable())), pytest.mark.serial]  # times the emulated link

RESULT_KEYS = {
    "row", "mode", "dtype", "rate_mbit", "inner_steps", "utilisation_wall", "utilisation_steady", "allreduce_s_mean",
    "wire_bytes_per_rank_per_outer_step", "bytes_per_param_per_sync", "achieved_bw_over_rate", "tokens_per_s_all_sites",
    "final_train_loss", "final_val_loss", "predicted",
}


@pytest.mark.timeout(180)
def test_bench_wan_quick(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_wan.py"), "--quick", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "|---:" in done.stdout and (tmp_path / "wan.md").read_text().strip()
    assert (tmp_path / "wan.png").stat().st_size > 0
    data = json.loads((tmp_path / "wan.json").read_text())
    assert data["meta"]["sites"] == 2 and data["meta"]["params"] > 0
    assert data["meta"]["streams"] == 1 and data["meta"]["window_bytes"] > 0  # the link model's inputs
    rows = {r["row"]: r for r in data["results"]}
    assert set(rows) == {"DP fp32 (per step)", "DiLoCo fp16"}
    for r in rows.values():
        assert RESULT_KEYS <= set(r)
        assert 0 < r["utilisation_steady"] <= 1 and 0 < r["utilisation_wall"] <= 1
        assert r["allreduce_s_mean"] > 0 and r["tokens_per_s_all_sites"] > 0
        assert 0 < r["achieved_bw_over_rate"] < 1.1  # the link cap holds
        assert r["final_train_loss"] > 0 and r["final_val_loss"] > 0
        assert r["predicted"]["comm_s"] > 0 and 0 < r["predicted"]["utilisation"] <= 1
    # counted at the interface: ~4 B (fp32) and ~2 B (fp16) per parameter per sync, plus TCP/IP headers
    assert rows["DP fp32 (per step)"]["bytes_per_param_per_sync"] == pytest.approx(4.0, rel=0.05)
    # fp16: counted inside the outer steps only, so the idle chatter of rounds that a loaded machine
    # stretches does not count (the whole-round count less the estimated chatter read 2.15 at load 10)
    fp16 = rows["DiLoCo fp16"]
    assert fp16["sync_wire_bytes_per_site_per_round"] / fp16["shard_params"] == pytest.approx(2.0, rel=0.05)
    assert rows["DiLoCo fp16"]["utilisation_steady"] > rows["DP fp32 (per step)"]["utilisation_steady"]
