"""End to end through the real launchers: torchrun per site, the `zeroband` command, HF export."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
import torch

from tests.helpers import tiny_overrides, zeroband_cli
from tests.inject import ENTRY, entry_env
from tests.multiproc import free_port


def _write(tree: dict, path: Path) -> str:
    path.write_text(tomli_w.dumps(tree))
    return str(path)


@pytest.mark.slow
def test_launch_two_sites_then_export(corpus, tmp_path):
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 6}, eval={"interval": 3})
    tree["diloco"] = {"inner_steps": 3}
    tree["sites"] = {"timeout_s": 120, "insecure": True}
    config = _write(tree, tmp_path / "run.toml")
    pin = ["--pin-cpus"] if len(os.sched_getaffinity(0)) >= 2 else []  # each site on its own core
    out = zeroband_cli("launch", config, "--sites", "2", "--nproc", "1", "--timeout", "100", *pin)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "DiLoCo 2 sites x 1 ranks: val ppl" in out.stdout
    assert "zeroband launch: WARNING: sites.insecure = true: cross-site messages are NOT authenticated" in out.stderr
    summary = json.loads(out.stdout[out.stdout.index("{") : out.stdout.rindex("}") + 1])
    assert summary["site0"]["outer_steps"] == 2 and summary["site0"]["val_loss"] == summary["site1"]["val_loss"]
    assert (tmp_path / "t" / "loss.png").is_file()
    for site in (0, 1):  # the insecure choice is a structured record in every site's metrics
        records = map(json.loads, (tmp_path / "t" / f"site{site}" / "metrics.jsonl").read_text().splitlines())
        assert [(r["setting"], r["step"]) for r in records if r["kind"] == "insecure"] == [("sites.insecure", 0)]

    hf_dir = tmp_path / "hf"
    out = zeroband_cli("export", config, "--diloco", "none", "--out", str(hf_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert result["max_logit_diff"] < 1e-5

    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir)
    ids = AutoTokenizer.from_pretrained(hf_dir)("the state of the world", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.slow
def test_train_command_runs_torchrun_with_two_ranks(corpus, tmp_path):
    config = _write(tiny_overrides(corpus, tmp_path, train={"steps": 4}), tmp_path / "run.toml")
    out = zeroband_cli("train", config, "--nproc", "2", "--checkpoint.interval", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    manifest = json.loads((tmp_path / "t" / "checkpoints" / "step_000000004" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 4


def test_cli_config_error_is_one_clear_line(tmp_path):
    out = zeroband_cli("train", "configs/demo.toml", "--optim.lrr", "1")
    assert out.returncode == 2 and "optim.lrr: unknown key" in out.stderr and "Traceback" not in out.stderr
    assert free_port() > 0


def _supervised_tree(corpus: dict, out: Path, steps: int = 8, **diloco: object) -> dict:
    tree = tiny_overrides(corpus, out, train={"steps": steps})
    tree["diloco"] = {"inner_steps": 2, **diloco}
    tree["sites"] = {"timeout_s": 60}  # no secret: the launcher makes the run's own
    return tree


def _launcher(config: str, *extra: str, faults: str | None = None) -> subprocess.Popen:
    entry = ["-m", "zeroband"] if faults is None else ["-m", ENTRY, "--faults", faults, "--"]
    env = {k: v for k, v in entry_env().items() if k != "ZEROBAND_SECRET"}
    return subprocess.Popen([sys.executable, *entry, "launch", config, "--sites", "2", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _lines_until_exit(proc: subprocess.Popen, timeout_s: float) -> list[tuple[float, str]]:
    """(seconds since start, line) of the launcher's stderr, as they come."""
    t0, lines = time.monotonic(), []
    try:
        for line in iter(proc.stderr.readline, ""):
            lines.append((time.monotonic() - t0, line.rstrip()))
            assert time.monotonic() - t0 < timeout_s, lines
        proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return lines


def _no_orphans(pids: list[int]) -> list[int]:
    time.sleep(0.5)
    return [p for p in pids if (Path(f"/proc/{p}/stat").is_file() and
                                Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launcher_names_a_stopped_site_and_ends_the_run_within_the_bound(corpus, tmp_path):
    """Site 1 SIGSTOPs itself at its first all-reduce. Before: the launcher waited for it forever."""
    from zeroband.tools.launch import descendants

    bound = 11.0  # > the watchdog's 10 s log interval, so site 0's "waiting" line is seen first
    config = _write(_supervised_tree(corpus, tmp_path, heartbeat_s=1.0, dead_after_s=bound), tmp_path / "run.toml")
    proc = _launcher(config, faults="site1:step2:allreduce:stop")
    tree: list[int] = []
    t0 = time.monotonic()
    while not tree and time.monotonic() - t0 < 30:
        tree = descendants(proc.pid)
    lines = _lines_until_exit(proc, 100)
    text = "\n".join(line for _, line in lines)
    stopped_at = next(t for t, line in lines if line.startswith("site 1 is stopped: process"))
    assert any(line.startswith("site 0: waiting 10 s for site 1") for _, line in lines), text
    assert proc.returncode == 1 and lines[-1][1].startswith("zeroband launch: site 1 failed: stopped (SIGSTOP) "
                                                            "for 11 s"), text
    assert lines[-1][0] - stopped_at < bound + 15, text  # the bound, then SIGTERM (+SIGCONT) ends both
    assert _no_orphans(tree + descendants(proc.pid)) == []


@pytest.mark.timeout(120)
def test_launcher_names_a_site_that_died_before_the_sites_connected(corpus, tmp_path):
    """Site 1 is SIGKILLed while it starts. Before: site 0 waited sites.timeout_s (60 s) to connect."""
    from zeroband.tools.launch import descendants

    config = _write(_supervised_tree(corpus, tmp_path, heartbeat_s=1.0, dead_after_s=3.0), tmp_path / "run.toml")
    proc = _launcher(config)
    t0, site1 = time.monotonic(), None
    while site1 is None and time.monotonic() - t0 < 30:
        for pid in descendants(proc.pid):
            try:
                if b"--sites.site_rank\x001\x00" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    site1 = pid
            except OSError:
                continue
    os.killpg(site1, signal.SIGKILL)  # its torchrun agent is still importing torch: no rank yet
    lines = _lines_until_exit(proc, 100)
    text = "\n".join(line for _, line in lines)
    assert "site 1 failed (killed by SIGKILL)\n" in text and "site 0 stopped" in text, text
    assert proc.returncode == 1 and lines[-1][1].startswith("zeroband launch: site 1 failed first (killed by SIGKILL); ")
    assert time.monotonic() - t0 < 35, text  # 3 s bound + stopping site 0; sites.timeout_s is 60


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_launch_without_a_secret_makes_one_for_the_run_and_shows_it_nowhere(corpus, tmp_path):
    from zeroband.tools.launch import descendants

    config = _write(_supervised_tree(corpus, tmp_path, steps=4), tmp_path / "run.toml")
    proc = _launcher(config, "--nproc", "1")
    argvs: set[bytes] = set()
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            try:
                argvs.add(Path(f"/proc/{pid}/cmdline").read_bytes())
            except OSError:
                pass
        time.sleep(0.2)
    out, err = proc.communicate()
    assert proc.returncode == 0 and "DiLoCo 2 sites x 1 ranks" in out, out + err
    secret_file = tmp_path / "t" / "launch.secret"
    secret = secret_file.read_text().strip().encode()
    assert secret_file.stat().st_mode & 0o777 == 0o600 and len(secret) >= 32
    assert len(argvs) >= 4 and [a for a in argvs if secret in a] == []  # store, 2 agents, their ranks
    assert secret.decode() not in out + err
    files = [p for p in (tmp_path / "t").rglob("*") if p.is_file() and p != secret_file]
    assert [str(p) for p in files if secret in p.read_bytes()] == []
    assert any('"signature"' in p.read_text() for p in files if p.name == "manifest.json")
    # A second launch of the run reuses its secret: the signed checkpoints verify, the run resumes.
    again = _launcher(config, "--nproc", "1", "--train.steps", "4")
    out, err = again.communicate(timeout=100)
    assert again.returncode == 0 and secret_file.read_text().strip().encode() == secret, out + err
    assert "resumed from" in (tmp_path / "t" / "logs" / "site0.log").read_text()


@pytest.mark.timeout(120)
def test_a_failing_two_rank_site_ends_in_one_line(corpus, tmp_path):
    config = _write(tiny_overrides(corpus, tmp_path), tmp_path / "run.toml")
    out = zeroband_cli("train", config, "--nproc", "2", "--data.path", str(tmp_path / "none.jsonl"))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr, out.stderr
    assert [line for line in lines if "error" in line.lower()] == [lines[-1]], out.stderr
    assert re.match(r"zeroband train: rank [01]: zeroband: error: data.path=.*none.jsonl' matches no file.*; "
                    r"full output in .*train.log$", lines[-1]), lines[-1]
    log = (tmp_path / "t" / "logs" / "train.log").read_text()  # the whole output stays there
    assert log.count("matches no file") == 2 and "zeroband.torchrun: first failure: rank" in log


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failing_two_rank_site_is_one_line_on_the_launchers_terminal(corpus, tmp_path):
    config = _write(_supervised_tree(corpus, tmp_path), tmp_path / "run.toml")
    proc = _launcher(config, "--nproc", "2", "--data.path", str(tmp_path / "none.jsonl"))
    lines = [line for _, line in _lines_until_exit(proc, 100)]
    assert proc.returncode == 1 and "Traceback" not in "\n".join(lines), lines
    for site in (0, 1):
        said = [line for line in lines if line.startswith(f"site {site} ")]
        assert len(said) == 1 and re.match(rf"site {site} failed \(exit code 2\): rank [01]: zeroband: error: "
                                           "data.path=.*matches no file", said[0]), lines
    assert re.match(r"zeroband launch: site [01] failed first \(exit code 2\): rank [01]: zeroband: error: "
                    "data.path=", lines[-1]), lines


def test_a_second_launch_of_a_running_run_stops_before_touching_its_logs(corpus, tmp_path):
    """Before: a second `zeroband launch` of the same name reopened runs/<name>/logs/site*.log with "w",
    emptying the running launch's logs, and printed the first run's progress as its own."""
    from zeroband.rundir import run_dir_lock

    tree = tiny_overrides(corpus, tmp_path, train={"steps": 2})
    tree["diloco"] = {"inner_steps": 2}
    config = _write(tree, tmp_path / "run.toml")
    logs = tmp_path / "t" / "logs"
    logs.mkdir(parents=True)
    (logs / "site0.log").write_text("the running launch's log\n")
    with run_dir_lock(logs, True):  # this test process plays the running launcher
        out = zeroband_cli("launch", config, "--sites", "2", "--nproc", "1", timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    [line] = [x for x in out.stderr.splitlines() if x.strip()]
    assert line.startswith(f"zeroband: error: {logs} is in use by another run: PID {os.getpid()} ("), line
    assert (logs / "site0.log").read_text() == "the running launch's log\n" and not (logs / "site1.log").exists()


@pytest.mark.slow
def test_launch_three_sites_of_different_shapes(corpus, tmp_path):
    """`--nproc 2,1,1`: site 0 runs torchrun with 2 ranks, the others 1 (issue 26). Before: --nproc took
    one integer. The sites' keyed digests agree after every outer step."""
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 4})
    tree["diloco"] = {"inner_steps": 2, "log_checksum": True}
    tree["sites"] = {"timeout_s": 60, "insecure": True}
    config = _write(tree, tmp_path / "run.toml")
    out = zeroband_cli("launch", config, "--sites", "3", "--nproc", "2,1,1", "--timeout", "100")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "DiLoCo 3 sites of 2,1,1 ranks: val ppl" in out.stdout
    crcs = []
    for site in range(3):
        records = map(json.loads, (tmp_path / "t" / f"site{site}" / "metrics.jsonl").read_text().splitlines())
        crcs.append([(r["step"], r["outer_crc"]) for r in records if r["kind"] == "outer"])
    assert len(crcs[0]) == 2 and crcs[0] == crcs[1] == crcs[2]
    bad = zeroband_cli("launch", config, "--sites", "3", "--nproc", "2,1")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "zeroband: error: --nproc 2,1 does not fit --sites 3: give one rank count for every site or 3 "
        "comma-separated counts >= 1 (e.g. --nproc 1,1,1)")
