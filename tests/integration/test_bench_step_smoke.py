"""scripts/bench_step.py --quick: the outer step by part on 2 forked sites, complete and consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
PARTS = {"d2h", "pseudo_grad", "stats", "encode", "mac", "network_wait", "decode", "review", "optimizer", "h2d"}


@pytest.mark.timeout(120)
def test_bench_step_quick(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_step.py"), "--quick", "--threads", "1,2", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "step.json").read_text())
    assert [r["threads"] for r in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert row["params"] == 4 * 256 * 256
        assert set(row["parts"]) == PARTS and all(v >= 0 for v in row["parts"].values())
        assert row["parts"]["encode"] > 0 and row["parts"]["mac"] > 0  # the exchange was timed, authenticated
        assert 0 < row["local_s"] <= row["outer_step_s"]
        assert sum(row["parts"].values()) <= row["outer_step_s"] * 1.01  # parts never overlap
        assert row["local_over_pass"] == pytest.approx(row["local_s"] / row["fused_pass_s"])
    assert "local / pass" in (tmp_path / "step.md").read_text()


@pytest.mark.timeout(120)
def test_bench_inner_quick_runs_both_loops_on_every_preset(tmp_path: Path) -> None:
    """The CUDA comparison's plumbing on the CPU: one process group for all presets, the trainer's
    step and the plain transformers loop on the same shapes (same parameter count), a report."""
    pytest.importorskip("transformers")
    cmd = [sys.executable, str(REPO / "scripts" / "bench_step.py"), "--inner", "--quick", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "inner_step.json").read_text())["rows"]
    assert [(r["preset"], r["loop"]) for r in rows] == [
        (p, loop) for p in ("debug", "demo") for loop in ("zeroband", "zeroband-FSDP2 (1 rank)", "plain LlamaForCausalLM")]
    for ours, fsdp, plain in zip(rows[::3], rows[1::3], rows[2::3]):
        assert ours["params"] == fsdp["params"] == plain["params"]
        assert ours["tokens_s"] > 0 and fsdp["tokens_s"] > 0 and plain["tokens_s"] > 0
    assert "plain LlamaForCausalLM" in (tmp_path / "inner_step.md").read_text()


def _committed_state() -> tuple[str, dict[str, int]]:
    """git status of the committed results, and their files' mtimes."""
    status = subprocess.run(["git", "status", "--porcelain", "benchmarks", "docs/results"], cwd=REPO,
                            capture_output=True, text=True).stdout
    mtimes = {str(p): p.stat().st_mtime_ns for d in ("benchmarks", "docs/results") for p in (REPO / d).rglob("*")}
    return status, mtimes


@pytest.mark.timeout(120)
def test_bench_quick_writes_to_a_temp_dir_and_never_to_benchmarks(tmp_path: Path) -> None:
    """Issue 28: `bench_step.py --quick` overwrote the committed benchmarks/step.{md,json}."""
    import os

    before = _committed_state()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    script = str(REPO / "scripts" / "bench_step.py")
    done = subprocess.run([sys.executable, script, "--quick"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    wrote = done.stdout.strip().splitlines()[-1]
    [where] = [p for p in tmp_path.iterdir() if p.name.startswith("zeroband-step-")]
    assert wrote == f"wrote {where / 'step.json'}, {where / 'step.md'}" and (where / "step.json").is_file()
    refused = subprocess.run([sys.executable, script, "--quick", "--out", "benchmarks"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and refused.stdout == "", refused.stdout
    [line] = refused.stderr.strip().splitlines()
    assert "never writes to benchmarks/" in line and "drop --quick" in line, line
    assert _committed_state() == before
