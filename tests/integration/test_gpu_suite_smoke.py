"""scripts/gpu_suite.py: the cache, budget and resume logic (in-process), the fixed checks, and the
--quick CPU smoke test of every row kind through the real workers (two invocations: the first stops
at its budget, the second adds only the rows still missing)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import make_corpus
from tests.unit import test_gpu_suite_smoke as unit_tier  # what both tiers share is defined there, once

REPO = unit_tier.REPO

sys.path.insert(0, str(REPO / "scripts"))

from gpu_suite import (  # noqa: E402
    load_cache,
)


@pytest.mark.slow
def test_quick_runs_every_row_kind_and_resumes(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus.jsonl", n_docs=120)
    out = tmp_path / "suite"
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_suite.py"), "--quick", "--corpus", str(corpus), "--out", str(out),
           "--cache-dir", str(tmp_path / "cache")]
    # 12 s of estimates: the three speed rows at the head of the plan (4 s each) and nothing else, so the
    # first invocation starts one worker, not two (a worker is a fresh torch import); the rest is left
    first = subprocess.run([*cmd, "--budget-s", "12"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    measured = load_cache(out)["rows"]
    assert 0 < len(measured) < 25 and "left (run the same command again)" in first.stdout
    time.sleep(0.01)
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    cache = load_cache(out)
    assert cache["failures"] == {}, cache["failures"]
    assert len(cache["rows"]) == 25 and "suite complete" in second.stdout
    assert all(cache["rows"][k]["at"] == v["at"] for k, v in measured.items())  # cached rows were not run again
    assert f"--- {next(iter(measured.values()))['name']}" not in second.stdout
    report = json.loads((out / "gpu_suite.json").read_text())
    kinds = {e["kind"] for e in report["rows"].values()}
    assert kinds == {"speed", "outer", "conv"} and report["missing"] == []
    assert report["rows"]["speed/shipped-1B"]["result"]["activation_checkpointing"] is True
    assert report["rows"]["speed/shipped-1B"]["result"]["accumulation"] == 2
    assert {c["status"] for c in report["checks"]} <= {"met", "NOT met"}  # every check computed, none pending
    md = (out / "gpu_suite.md").read_text()
    assert "6 N + 12 L d s" in md and "torch" in md and "commit" in md and "| conv/" not in md
    with pytest.raises(subprocess.CalledProcessError):  # quick numbers never land in benchmarks/
        subprocess.run([*cmd[:-4], "--out", str(REPO / "benchmarks" / "quick")], cwd=REPO, check=True,
                       capture_output=True, timeout=60)
