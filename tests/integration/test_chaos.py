"""Chaos in CI, reduced: a site is SIGKILLed mid-run and restarted; it re-joins and ends bitwise
identical to the others, and the survivors commit every round. Real torchrun site processes and
a store in its own process, as `scripts/chaos.py` runs them (the full suite lives there).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import chaos
from zeroband.tools.launch import free_port, store_process
from zeroband.tools.report import data_audit, data_clean

SITES, STEPS, KILL_STEP = 3, 160, 9
ROOT = Path(__file__).resolve().parents[2]


def overrides(corpus: dict[str, str], out: Path) -> list[str]:
    values = {
        "output_dir": out, "name": "c", "model.vocab_size": 384, "model.max_seq_len": 64,
        "data.path": corpus["path"], "data.tokenizer": corpus["tokenizer"], "data.seq_len": 32,
        "data.val_fraction": 0.1, "train.steps": STEPS, "eval.interval": 0, "eval.batches": 1, "log.interval": 10,
        "checkpoint.interval": 20, "checkpoint.keep_last": 20, "diloco.elastic": "true", "diloco.inner_steps": 2,
        "diloco.heartbeat_s": 0.5, "diloco.dead_after_s": 5, "diloco.grace_s": 1, "diloco.start_grace_s": 60,
        "sites.timeout_s": 30, "diloco.join_timeout_s": 60, "diloco.log_checksum": "true", "sites.insecure": "true",
    }
    return [x for k, v in values.items() for x in (f"--{k}", str(v))]


def run_until_done(sites: list[chaos.SiteProcess], deadline_s: float) -> None:
    """Restart site 2 as soon as its planned kill took it down; wait for everyone."""
    deadline = time.monotonic() + deadline_s
    victim = sites[2]
    try:
        while any(p.running for p in sites):
            if time.monotonic() > deadline:
                pytest.fail(f"sites still running after {deadline_s:.0f} s: {[p.site for p in sites if p.running]}")
            if len(victim.incarnations) == 1 and victim.poll() is not None:
                victim.start()  # same slot, same command, no fault this time: resumes, re-joins as fresh
            time.sleep(0.2)
    finally:
        for p in sites:
            p.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and process sessions")
def test_killed_site_rejoins_identical(corpus, tmp_path):
    if shutil.which("ip") is None and not Path("/proc/self/task").is_dir():
        pytest.skip("no /proc task listing")
    port = free_port()
    with store_process(["127.0.0.1", port], lambda cmd: cmd):
        sites = chaos.make_sites(str(ROOT / "configs" / "debug.toml"), SITES, f"tcp://127.0.0.1:{port}",
                                 overrides(corpus, tmp_path), tmp_path / "logs", lambda s, c: c, lambda s: {})
        for p in sites:
            p.start(f"site2:step{KILL_STEP}:inner:kill" if p.site == 2 else "")
        run_until_done(sites, 105)
    victim = sites[2]
    assert victim.incarnations[0].returncode != 0, "the planned kill did not happen"
    assert [p.poll() for p in sites] == [0, 0, 0], [p.poll() for p in sites]

    records = {i: chaos.outer_records(tmp_path / "c" / f"site{i}" / "metrics.jsonl") for i in range(SITES)}
    for i in (0, 1):  # survivors: every round committed exactly once, none skipped
        assert [r["step"] for r in records[i]] == list(range(2, STEPS + 1, 2)), f"site {i} missed a round"
    table = chaos.crc_table(records)
    assert chaos.crc_mismatches(table) == []
    assert len(table[STEPS]) == SITES, "the restarted site did not log the final outer step"
    data = data_audit(tmp_path / "c" / f"site{i}" / "metrics.jsonl" for i in range(SITES))  # the data ledger's records
    assert data["committed"] == data["committed_once"] > 0 and data_clean(data), data
    decisions = chaos.read_decisions(tmp_path / "c" / f"site{i}" / "metrics.jsonl" for i in range(SITES))
    rejoin = chaos.first_inclusion(decisions, 2, victim.incarnations[1].started)
    assert rejoin is not None and 2 in rejoin.fresh, "site 2 was not re-admitted as a fresh joiner"

    ckpts = tmp_path / "c" / "checkpoints"
    count, errors = chaos.verify_all_checkpoints(ckpts)
    assert count and not errors, errors
    finals = [chaos.final_checkpoint(ckpts, i) for i in range(SITES)]
    assert all(f is not None and f.name == f"step_{STEPS:09d}" for f in finals), finals
    weights = [chaos.load_weights(tmp_path / "c" / f"site{i}" / "config.toml", f) for i, f in enumerate(finals)]
    assert all(chaos.same_weights(weights[0], w) for w in weights[1:]), "final checkpoints differ"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find the site processes")
def test_fixed_mode_frozen_peer_then_resume(corpus, tmp_path):
    """Default (non-elastic) mode under the real launcher: site 1's rank is SIGSTOPped mid-run;
    site 0 exits within sites.timeout_s naming site 1, SIGCONT ends site 1 too, nothing hangs;
    the relaunch resumes both sites from their newest common checkpoint and finishes identical."""
    timeout_s = 6.0
    values = {
        "output_dir": tmp_path, "name": "f", "model.vocab_size": 384, "model.max_seq_len": 64,
        "data.path": corpus["path"], "data.tokenizer": corpus["tokenizer"], "data.seq_len": 32,
        "data.val_fraction": 0.1, "train.steps": 40, "eval.interval": 0, "eval.batches": 1, "log.interval": 2,
        "checkpoint.interval": 4, "checkpoint.keep_last": 3, "diloco.inner_steps": 2,
        "sites.timeout_s": timeout_s, "sites.insecure": "true",
    }
    run = chaos.FixedRun(str(ROOT / "configs" / "debug.toml"), [x for k, v in values.items() for x in (f"--{k}", str(v))],
                         tmp_path, "f")
    result = chaos.frozen_peer(run, at_step=10, timeout_s=timeout_s, then="cont", bound_s=80)
    assert result.injected == 1 and result.hung == 0 and result.data_lost == 0, result
    assert result.detected_s is not None and result.detected_s < timeout_s + 15, result
    assert "no answer from site 1" in result.message and run.resumed_step() >= 8, result
    assert result.lost_steps < 4 + 2 * 2, result  # at most a checkpoint interval and the round in flight


@pytest.mark.timeout(120)
def test_chaos_stops_on_a_sites_configuration_error_instead_of_restarting_it(tmp_path):
    """Run where the config's demo tokenizer does not exist: every site exits 2 at its start. The
    harness ends the run on the first such exit with the site's own error line (before, it restarted
    the sites until its 900 s deadline; the test's timeout is far below that)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--sites", "2", "--faults", "1",
                           "--no-baseline", "--insecure", "--workdir", str(tmp_path / "work"), "--out",
                           str(tmp_path / "out")], cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "stopped on its configuration (exit 2)" in last and "tokenizer" in last, last
