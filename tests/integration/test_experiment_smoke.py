"""The convergence benchmark runs end to end in --quick mode on a small synthetic corpus."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_corpus

REPO = Path(__file__).resolve().parent.parent.parent
SCRIPT = REPO / "scripts" / "experiments" / "convergence.py"


@pytest.mark.slow
def test_convergence_quick(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus.jsonl", n_docs=160)
    out = tmp_path / "results"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--corpus", str(corpus),
           "--cache", str(tmp_path / "cache")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-4000:]
    for name in ("convergence.md", "convergence_vs_tokens.png", "convergence_vs_bytes.png"):
        assert (out / name).stat().st_size > 0, name
    runs = json.loads((out / "convergence.json").read_text())["runs"]
    rows = {r["row"]: r for r in runs}
    assert {"single", "single_kx", "dp", "diloco_default_many", "diloco_default_few", "plain_avg_many",
            "diloco_default_many_eager", "diloco_default_many_int8_ef", "muon_diloco_many_int4_ef"} <= set(rows)
    assert all(math.isfinite(r["val_loss"]) and r["curve"] for r in runs)
    # DP sends fp32 gradients every step; DiLoCo sends fp16 every H = 1 step in the quick "many" regime.
    assert rows["dp"]["payload_bytes"] == pytest.approx(2 * rows["diloco_default_many"]["payload_bytes"])
    assert rows["diloco_default_few"]["outer_steps"] == 10 and rows["diloco_default_many"]["outer_steps"] == 20
    md = (out / "convergence.md").read_text()
    assert "convergence.py --quick" in md and "| dp |" in md and "Acceptance checks" in md


@pytest.mark.slow
@pytest.mark.timeout(300)  # 9 runs and a canary, each a fresh process importing torch
def test_large_h_quick_stops_on_its_budget_and_accumulates(tmp_path: Path) -> None:
    """A first invocation out of budget ends its runs; the second runs only what is left and writes
    the report from every row, the first invocation's included."""
    corpus = make_corpus(tmp_path / "corpus.jsonl", n_docs=160)
    out = tmp_path / "results"
    cmd = [sys.executable, str(SCRIPT.parent / "large_h.py"), "--quick", "--out", str(out), "--corpus", str(corpus),
           "--cache", str(tmp_path / "cache"), "--nice", "0"]
    first = subprocess.run([*cmd, "--budget-s", "3"], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "running the code-version canary" in first.stdout and "start h100/single seed 0" in first.stdout and "budget of 3 s spent; 9 runs left" in first.stdout
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=200)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "canary" not in second.stdout  # the same sources: the first invocation's canary stands
    rows = [json.loads(p.read_text()) for p in (out / "large_h" / "runs").glob("*.json")]
    assert sorted(r["row"] for r in rows) == sorted(["single", "dp_lr0.003", "dp_lr0.006", "defaults_h4",
                                                     "paper_0.7_0.9_h4", "scaling_law_h4", "plain_avg_h4",
                                                     "fragments4_fp16_h4", "sparse0.02_h4"])
    # DiLoCo: T / H = 2 outer steps; data parallel logs its byte totals as "outer" records every 4 steps too
    # 4 fragments: a record at every step, one fragment each (the end: all four in one record)
    steps = {"single": 0, "fragments4_fp16_h4": 8}
    assert all(math.isfinite(r["val_loss"]) and r["outer_steps"] == steps.get(r["row"], 2) for r in rows)
    assert len({r["version"] for r in rows}) == 1
    md = (out / "large_h.md").read_text()
    assert "9 runs of 9 planned are done" in md and "(tuned)" in md and (out / "large_h.png").stat().st_size > 0
    assert "- h100_wire, H = 4: `fragments4_fp16_h4`" in md and "against whole-model fp16 `defaults_h4`" in md
    third = subprocess.run(cmd + ["--report"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert third.returncode == 0 and "start " not in third.stdout  # every row cached: nothing runs again
