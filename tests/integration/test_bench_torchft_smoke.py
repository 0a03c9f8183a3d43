"""scripts/bench_torchft.py --quick runs torchft's DiLoCo and zeroband side by side and writes a complete report.

torchft is not one of zeroband's dependencies: without it the test is skipped, not failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
DATA = REPO / "data" / "demo"

pytest.importorskip("torchft", reason="torchft not installed (optional benchmark peer: pip install torchft)")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(250),  # not measured here (needs torchft and the demo corpus); the bound it had
    pytest.mark.skipif(not (DATA / "train.jsonl").is_file() or not (DATA / "tokenizer").is_dir(),
                       reason="demo corpus missing: run `zeroband data`"),
]


def test_bench_torchft_quick(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_torchft.py"), "--quick", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "|---:" in done.stdout
    assert (tmp_path / "torchft.md").read_text().strip()
    data = json.loads((tmp_path / "torchft.json").read_text())
    results = data["links"]["loopback"]
    tf, zb = results["torchft"], results["zeroband fp16"]
    for r in (tf, zb):
        for key in ("tokens_per_s", "step_s", "sync_s", "payload_bytes", "computed_wire_bytes_per_sync"):
            assert r[key] > 0, (r["system"], key)
    assert tf["replicas_identical"]  # torchft's outer step leaves every replica with the same weights
    assert tf["payload_bytes"] == 4 * tf["numel"]  # torchft all-reduces fp32 pseudo-gradients
    assert zb["payload_bytes"] * 2 == tf["payload_bytes"]  # same model, fp16 on the wire
    # same model, data, schedule and H: the runs track each other (fp16 rounding of the average aside)
    assert zb["val_loss"] == pytest.approx(tf["val_loss"], abs=0.05)
    ratio = data["ratios"]["loopback"]["zeroband fp16 / torchft"]
    assert ratio["bytes_per_sync"] == pytest.approx(0.5, rel=1e-4)  # fp16 vs fp32, + 4-byte scale per message
    assert ratio["tokens_per_s"] > 0
