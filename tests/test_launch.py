"""End to end through the real launchers: torchrun per site, the `zeroband` command, HF export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tomli_w
import torch

from tests.helpers import tiny_overrides
from tests.multiproc import free_port
from zeroband.tools.launch import site_cpus


def _zeroband(*args: str, timeout: float = 110) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "zeroband", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _write(tree: dict, path: Path) -> str:
    path.write_text(tomli_w.dumps(tree))
    return str(path)


def test_launch_two_sites_then_export(corpus, tmp_path):
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 6}, eval={"interval": 3})
    tree["diloco"] = {"inner_steps": 3}
    tree["sites"] = {"timeout_s": 120, "insecure": True}
    config = _write(tree, tmp_path / "run.toml")
    pin = ["--pin-cpus"] if len(os.sched_getaffinity(0)) >= 2 else []  # each site on its own core
    out = _zeroband("launch", config, "--sites", "2", "--nproc", "1", "--timeout", "100", *pin)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "DiLoCo 2 sites x 1 ranks: val ppl" in out.stdout
    summary = json.loads(out.stdout[out.stdout.index("{") : out.stdout.rindex("}") + 1])
    assert summary["site0"]["outer_steps"] == 2 and summary["site0"]["val_loss"] == summary["site1"]["val_loss"]
    assert (tmp_path / "t" / "loss.png").is_file()
    for site in (0, 1):  # the insecure choice is a structured record in every site's metrics
        records = map(json.loads, (tmp_path / "t" / f"site{site}" / "metrics.jsonl").read_text().splitlines())
        assert [(r["setting"], r["step"]) for r in records if r["kind"] == "insecure"] == [("sites.insecure", 0)]

    hf_dir = tmp_path / "hf"
    out = _zeroband("export", config, "--diloco", "none", "--out", str(hf_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert result["max_logit_diff"] < 1e-5

    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir)
    ids = AutoTokenizer.from_pretrained(hf_dir)("the state of the world", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()


def test_train_command_runs_torchrun_with_two_ranks(corpus, tmp_path):
    config = _write(tiny_overrides(corpus, tmp_path, train={"steps": 4}), tmp_path / "run.toml")
    out = _zeroband("train", config, "--nproc", "2", "--checkpoint.interval", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    manifest = json.loads((tmp_path / "t" / "checkpoints" / "step_000000004" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 4


def test_cli_config_error_is_one_clear_line(tmp_path):
    out = _zeroband("train", "configs/demo.toml", "--optim.lrr", "1")
    assert out.returncode == 2 and "optim.lrr: unknown key" in out.stderr and "Traceback" not in out.stderr
    assert free_port() > 0


def test_site_cpus_are_disjoint_and_refuse_too_many_sites():
    cpus = sorted(os.sched_getaffinity(0))
    sets = [set(map(int, s.split(","))) for s in site_cpus(len(cpus))]
    assert all(len(s) == 1 for s in sets) and set().union(*sets) == set(cpus)
    try:
        site_cpus(len(cpus) + 1)
    except ValueError as e:
        assert "one CPU per site" in str(e)
    else:
        raise AssertionError("more sites than CPUs must be refused")
