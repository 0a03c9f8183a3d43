"""The benchmark scripts run end to end in --quick mode and write complete, positive results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
DATA = REPO / "data" / "demo"

pytestmark = pytest.mark.skipif(
    not (DATA / "train.jsonl").is_file() or not (DATA / "tokenizer").is_dir(),
    reason="demo corpus missing: run `zeroband data`",
)


def run_quick(script: str, out: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "|---:" in done.stdout  # the markdown table is printed
    name = script.removeprefix("bench_").removesuffix(".py")
    assert (out / f"{name}.md").read_text().strip()
    return json.loads((out / f"{name}.json").read_text())


def assert_positive(record: dict[str, Any], keys: list[str]) -> None:
    for key in keys:
        assert isinstance(record[key], (int, float)) and record[key] > 0, (key, record.get(key))


def test_bench_train_quick(tmp_path: Path) -> None:
    data = run_quick("bench_train.py", tmp_path)
    runs = data["runs"]
    assert [(r["ranks"], r["mode"]) for r in runs] == [(1, "eager"), (2, "eager")]
    for r in runs:
        assert_positive(r, ["tokens_per_s", "step_s", "peak_rss_mb", "warmup_s", "tokens_per_step", "timed_steps"])
        assert r["warmup_overhead_s"] >= 0
        assert len(r["peak_rss_mb_per_rank"]) == r["ranks"]


def test_bench_diloco_quick(tmp_path: Path) -> None:
    data = run_quick("bench_diloco.py", tmp_path)
    assert set(data["comm"]) == {"fp32", "bf16", "fp16"}
    for dtype, c in data["comm"].items():
        assert_positive(c, ["payload_bytes", "wire_bytes_ring_est", "dp_fp32_ring_bytes_over_h", "reduction_factor",
                            "outer_step_s_mean", "inner_step_s_mean", "outer_fraction_measured_h",
                            "outer_fraction_h500_derived"])
        h = data["meta"]["inner_steps"]
        assert c["reduction_factor"] == pytest.approx(h * (1 if dtype == "fp32" else 2))
    mem = data["memory"]
    assert_positive(mem, ["shard_bytes", "outer_copy_bytes", "momentum_bytes", "outer_state_bytes"])
    assert mem["outer_state_bytes"] == mem["expected_outer_state_bytes"]
    assert data["comm"]["fp32"]["shard_numel_from_payload"] == mem["shard_numel"]
