"""The convergence experiment runs end to end in --quick mode on a small synthetic corpus."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_corpus

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "experiments" / "diloco_vs_dp.py"


@pytest.mark.slow
def test_diloco_vs_dp_quick(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus.jsonl", n_docs=160)
    out = tmp_path / "results"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--corpus", str(corpus),
           "--cache", str(tmp_path / "cache")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=290)
    assert done.returncode == 0, done.stderr[-4000:]
    for name in ("diloco_vs_dp.md", "val_loss_vs_tokens.png", "val_loss_vs_bytes.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "diloco_vs_dp.json").read_text())
    rows = {r["row"] for r in data["runs"]}
    assert {"baseline", "data_parallel", "diloco_H6_fp32", "diloco_H6_fp16", "diloco_H6_int8_ef"} <= rows
    assert all(math.isfinite(r["val_loss"]) and r["curve"] for r in data["runs"])
    dp = next(r for r in data["runs"] if r["row"] == "data_parallel")
    dl = next(r for r in data["runs"] if r["row"] == "diloco_H6_fp32")
    assert dp["payload_bytes"] == pytest.approx(6 * dl["payload_bytes"])  # DP sends every step, DiLoCo every H=6
    md = (out / "diloco_vs_dp.md").read_text()
    assert "diloco_vs_dp.py --quick" in md and "| data_parallel |" in md
