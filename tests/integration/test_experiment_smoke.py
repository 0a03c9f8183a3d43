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
