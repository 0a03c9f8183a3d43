"""The test-side fault injector alone: the schedule, which seam fires when, and that it leaves no trace.

The entry point for subprocess runs is tested last; the end-to-end uses (kills mid all-reduce, mid
save, between the seal renames) are in test_elastic, test_train, test_checkpoint_safety and test_chaos.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tomli_w

from tests.helpers import tiny_overrides
from tests.inject import ENTRY, entry_env
from tests.unit import test_faults as unit_tier  # what both tiers share is defined there, once

_clean = unit_tier._clean


def _inject(faults: str, *command: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", ENTRY, "--faults", faults, "--", *command]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=entry_env())


def test_inject_entry_point_runs_the_trainer_with_the_fault(corpus, tmp_path):
    tree = tiny_overrides(corpus, tmp_path)
    (tmp_path / "run.toml").write_text(tomli_w.dumps(tree))
    out = _inject("site0:step3:inner:raise", "train", str(tmp_path / "run.toml"))
    assert out.returncode != 0 and "injected fault at site 0 rank 0 step 3 (inner)" in out.stderr, out.stderr[-2000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2  # logged every 2 steps: step 2, then the fault at the end of step 3


@pytest.mark.slow
def test_inject_under_launch_arms_the_sites(corpus, tmp_path):
    """`-- launch`: every site's ranks start through the entry point; site 1's pseudo-gradient of
    outer step 2 is NaN and both sites exclude it, as the fixed-mode chaos scenario expects."""
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 6})
    tree["diloco"] = {"inner_steps": 2}
    tree["sites"] = {"timeout_s": 60, "insecure": True}
    (tmp_path / "run.toml").write_text(tomli_w.dumps(tree))
    out = _inject("site1:step4:allreduce:nan", "launch", str(tmp_path / "run.toml"), "--sites", "2", "--timeout", "90")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for site in (0, 1):
        lines = (tmp_path / "t" / f"site{site}" / "metrics.jsonl").read_text().splitlines()
        excluded = {r["step"]: r["excluded_sites"] for r in map(json.loads, lines) if r["kind"] == "outer"}
        assert excluded == {2: [], 4: [1], 6: []}, (site, excluded)
