"""scripts/bench_allreduce.py on a small payload behind an emulated link: complete, sane results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent


def _unusable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices, tc)"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` unavailable"
    return None


pytestmark = pytest.mark.skipif(_unusable() is not None, reason=str(_unusable()))


@pytest.mark.timeout(120)
def test_bench_allreduce_small(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_allreduce.py"), "--rates-mbit", "200", "--delay-ms", "5",
           "--params", "3e5", "--repeats", "1", "--wires", "fp32,int4", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["wire"]: r for r in json.loads((tmp_path / "allreduce.json").read_text())["rows"]}
    assert set(rows) == {"fp32", "int4"}
    # 2 sites: each sends half its payload in the scatter and half in the gather, plus headers/ACKs
    assert rows["fp32"]["payload_mb"] == pytest.approx(1.2, rel=0.01)
    for r in rows.values():
        assert r["payload_mb"] <= r["wire_mb"] <= 1.1 * r["payload_mb"] + 0.05
        assert 0 < r["bw_over_rate"] <= 1.05 and r["seconds_mean"] >= r["ideal_s"] * 0.95
    assert rows["int4"]["wire_mb"] < rows["fp32"]["wire_mb"] / 6  # ~0.53 vs 4 bytes per value
    assert "BW / rate" in (tmp_path / "allreduce.md").read_text()
