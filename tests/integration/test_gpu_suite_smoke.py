"""scripts/gpu_suite.py --quick: the first call and one convergence call through the real workers (the
fair speed rows with their attention profiles, the outer step's forked sites, convergence sites as
forked processes of the production trainer), each row appended the moment it ends; then the same
calls again with that rows file carried back, which run nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_corpus

REPO = Path(__file__).resolve().parent.parent.parent
CALLS = "first,conv-h100-seed0-1"
ROWS = ["speed/bench-150M", "speed/bench-1B", "outer/1B", "conv/h100/single/seed0", "conv/h100/dp/seed0",
        "conv/h100/defaults/seed0"]


@pytest.mark.slow
@pytest.mark.timeout(240)  # ~30 s of CPU time; the wall time grows with the machine's load
def test_quick_calls_write_rows_as_they_finish_and_a_rerun_skips_them(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus.jsonl", n_docs=120)
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_suite.py"), "--quick", "--call", CALLS, "--corpus", str(corpus),
           "--cache-dir", str(tmp_path / "cache")]
    first = subprocess.run([*cmd, "--out", str(tmp_path / "a")], cwd=REPO, capture_output=True, text=True, timeout=200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "a" / "rows.jsonl").read_text().splitlines()]
    assert [e["name"] for e in lines] == ROWS and {e["status"] for e in lines} == {"done"}
    for name in ROWS:  # the estimate is printed before the row runs
        assert first.stdout.index(f"--- {name}: estimated") < first.stdout.index("done in", first.stdout.index(name))
    env = lines[0]["env"]
    assert {"gpu", "torch", "cuda", "transformers", "commit"} <= env.keys()
    speed = lines[0]["result"]["loops"]
    assert speed["zeroband"]["attention"] and speed["zeroband"]["attention"].keys() == speed["plain"]["attention"].keys()
    assert lines[-1]["result"]["outer_steps"] == 4  # T = 8, H = 2: the sites met four times
    assert "6 of 6 rows of this call measured" in first.stdout and "call complete" in first.stdout
    report = json.loads((tmp_path / "a" / "gpu_suite.json").read_text())
    assert set(report["rows"]) == set(ROWS)
    assert {c["status"] for c in report["checks"] if "bench shapes" in c["check"] or "outer" in c["check"]} <= {"met", "NOT met"}
    assert "6 N + 12 L d s" in (tmp_path / "a" / "gpu_suite.md").read_text()

    again = subprocess.run([*cmd, "--out", str(tmp_path / "b"), "--results", str(tmp_path / "a" / "rows.jsonl")],
                           cwd=REPO, capture_output=True, text=True, timeout=30)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "6 rows already measured, 0 to run" in again.stdout and "--- " not in again.stdout
    assert not (tmp_path / "b" / "rows.jsonl").exists()
    assert set(json.loads((tmp_path / "b" / "gpu_suite.json").read_text())["rows"]) == set(ROWS)
