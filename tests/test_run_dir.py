"""A run directory says what really ran, belongs to one run at a time, and keeps what came before:
settings changed on resume are applied and said (or refused, naming the key), a second run with the
same name stops naming the first, and a fresh start moves the previous run aside instead of
deleting it. Pure rules in-process; the rest on real trainer processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import _main, _train, tiny_overrides
from tests.multiproc import run_ranks
from zeroband.checkpoint import read_run_id
from zeroband.config import deep_merge, dump_config, validate_config
from zeroband.resume_rules import config_changes, refusal, resume_rule
from zeroband.rundir import RunDirBusy, old_victims, run_dir_lock

pytestmark = pytest.mark.timeout(120)


def _tree(corpus: dict, out: Path, **extra: object) -> dict:
    base = {"train": {"steps": 4}, "checkpoint": {"interval": 2}, "optim": {"schedule": "constant", "warmup_steps": 0}}
    return tiny_overrides(corpus, out, **deep_merge(base, extra))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _toml(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


# ---------------------------------------------------------------------------------- pure rules


def test_resume_rules_apply_cadence_refuse_state_and_ignore_plumbing():
    assert [resume_rule(k)[0] for k in ("optim.lr", "train.steps", "optim.schedule", "eval.interval", "log.interval",
                                        "checkpoint.interval", "checkpoint.keep_old", "diloco.outer_lr")] == ["change"] * 8
    assert [resume_rule(k)[0] for k in ("model.dim", "data.path", "data.shuffle_seed", "train.seed", "optim.name",
                                        "diloco.inner_steps", "diloco.comm_dtype", "sites.site_count",
                                        "diloco", "newsection.key")] == ["refuse"] * 10
    assert [resume_rule(k)[0] for k in ("name", "sites.store", "checkpoint.resume", "model.preset")] == ["ignore"] * 4


def test_config_changes_between_two_resolved_configs(tmp_path):
    corpus = {"path": "/data/train.jsonl", "tokenizer": "/data/tokenizer"}  # only compared, never read
    old = validate_config(_tree(corpus, tmp_path)).model_dump(mode="json")
    new = validate_config(_tree(corpus, tmp_path / "elsewhere", optim={"lr": 1e-4}, train={"steps": 6},
                                checkpoint={"resume": "none"})).model_dump(mode="json")
    changes = config_changes(old, new)  # output_dir and checkpoint.resume are this launch's own: not listed
    assert [c.line() for c in changes] == ["optim.lr: 0.003 -> 0.0001 from this resume on",
                                           "train.steps: 4 -> 6 from this resume on"]
    assert refusal(changes, "ckpt") is None
    shape = config_changes(old, deep_merge(new, {"model": {"dim": 128}, "data": {"shuffle_seed": 7}}))
    line = refusal(shape, "ckpt")
    assert line.startswith("data.shuffle_seed cannot change on resume: ckpt was trained with data.shuffle_seed = 1234")
    assert "also changed: model.dim" in line and "Fix: --data.shuffle_seed 1234" in line and "\n" not in line
    section = refusal(config_changes(old, {**old, "diloco": {"inner_steps": 2}}), "ckpt")
    assert section.startswith("diloco cannot change on resume") and "Fix: --diloco none" in section


def test_old_victims_keep_the_newest_retired_runs_only():
    names = ["old-20261126-031700", "old-20261126-031700-1", "old-20250101-000000", "old-3fa9c2d1e0b4", "site0",
             "old-20261126-031659"]
    assert old_victims(names, 2) == ["old-20250101-000000", "old-20261126-031659"]
    assert old_victims(names, 0) == sorted(n for n in names if n[4:6] == "20")
    assert old_victims(names, 9) == []
    assert old_victims(["old-20261126-031700-10", "old-20261126-031700-9"], 1) == ["old-20261126-031700-9"]


def test_a_held_run_dir_refuses_a_second_owner_naming_the_first(tmp_path):
    with run_dir_lock(tmp_path, owner=True):
        with run_dir_lock(tmp_path, owner=False):  # the site's other ranks take nothing
            pass
        with pytest.raises(RunDirBusy, match=f"in use by another run: PID {os.getpid()} "):
            with run_dir_lock(tmp_path, owner=True):
                pass
    with run_dir_lock(tmp_path, owner=True):  # released with its holder
        pass


def test_a_loaded_optimizer_keeps_this_runs_settings_and_schedule():
    from zeroband.config import OptimConfig
    from zeroband.optim import build_optimizer, build_scheduler, hyperparameters_kept

    def built(**cfg: object) -> tuple:
        params = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))]
        opt = build_optimizer(params, OptimConfig(warmup_steps=0, schedule="constant", **cfg))
        return params, opt, build_scheduler(opt, OptimConfig(warmup_steps=0, schedule="constant", **cfg), 10)

    params, opt, sched = built(lr=3e-3, weight_decay=0.1)
    params[0].grad, params[1].grad = torch.ones(2, 2), torch.ones(2)
    for _ in range(3):
        opt.step()
        sched.step()
    _, new_opt, new_sched = built(lr=1e-4, weight_decay=0.0)
    with hyperparameters_kept(new_opt, new_sched):
        new_opt.load_state_dict(opt.state_dict())
        new_sched.load_state_dict(sched.state_dict())
    assert [g["lr"] for g in new_opt.param_groups] == [1e-4, 1e-4] == new_sched.get_last_lr()
    assert new_opt.param_groups[0]["weight_decay"] == 0.0 and new_sched.last_epoch == 3
    assert new_opt.state_dict()["state"][0]["step"] == 3  # the state itself is the checkpoint's


# ---------------------------------------------------------------------------------- real runs


def test_resume_applies_a_new_lr_and_step_count_and_says_so(corpus, tmp_path, capfd):
    """Before: the scheduler's saved base lr won, the run trained on at 3e-3 while config.toml said 1e-4."""
    tree = _tree(corpus, tmp_path)
    run_ranks(_train, 1, (tree,))
    capfd.readouterr()
    code, err = run_ranks(_main, 1, ([str(_written(tree)), "--optim.lr", "1e-4", "--train.steps", "6"],))[0]
    assert code == 0, err
    out = capfd.readouterr().out.splitlines()
    assert "optim.lr: 0.003 -> 0.0001 from this resume on" in out and "train.steps: 4 -> 6 from this resume on" in out
    records = _records(tmp_path / "t")
    assert [(r["step"], r["lr"]) for r in records if r["kind"] == "train"] == [(2, 3e-3), (4, 3e-3), (6, 1e-4)]
    [resumed] = [r for r in records if r["kind"] == "resumed"]
    assert resumed["changed"] == {"optim.lr": ["0.003", "0.0001"], "train.steps": ["4", "6"]}
    saved = _toml(tmp_path / "t" / "config.toml")
    assert (saved["optim"]["lr"], saved["train"]["steps"]) == (1e-4, 6)


def _written(tree: dict) -> Path:
    path = Path(tree["output_dir"]) / "cfg.toml"
    dump_config(validate_config(tree), path)
    return path


@pytest.mark.parametrize("change", [["--model.dim", "128"], ["--data.shuffle_seed", "7"]])
def test_resume_refuses_a_new_model_shape_or_data_order_naming_the_key(corpus, tmp_path, change):
    tree = _tree(corpus, tmp_path)
    run_ranks(_train, 1, (tree,))
    before = (tmp_path / "t" / "config.toml").read_text()
    code, err = run_ranks(_main, 1, ([str(_written(tree)), *change],))[0]
    key = change[0][2:]
    assert code == 2 and "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if line.startswith("zeroband: error:")]
    assert f"{key} cannot change on resume" in line and f"Fix: --{key} {'64' if key == 'model.dim' else '1234'}" in line
    assert (tmp_path / "t" / "config.toml").read_text() == before  # still what the run really used


def test_a_second_run_with_the_same_name_stops_naming_the_first(corpus, tmp_path):
    """Before: both ran in runs/t/, the second truncated the first's metrics.jsonl and overwrote its config."""
    tree = _tree(corpus, tmp_path, train={"steps": 100000}, checkpoint={"interval": 0}, log={"interval": 1})
    first = subprocess.Popen([sys.executable, "-m", "zeroband", "train", str(_written(tree))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "t" / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.is_file() and metrics.stat().st_size > 200) and first.poll() is None:
            assert time.monotonic() < deadline, "the first run never started training"
            time.sleep(0.2)
        code, err = run_ranks(_main, 1, ([str(_written(deep_merge(tree, {"train": {"steps": 2}})))],))[0]
        assert code == 2, err
        assert err.splitlines()[-1].startswith(f"zeroband: error: {tmp_path / 't'} is in use by another run: "
                                               f"PID {first.pid} ("), err
        assert "zeroband train" in err.splitlines()[-1]
        assert first.poll() is None  # untouched: still training, its records still its own
    finally:
        first.send_signal(signal.SIGTERM)
        _, first_err = first.communicate(timeout=60)
    assert first.returncode == 0, first_err[-2000:]
    records = _records(tmp_path / "t")
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert records[0]["kind"] == "run" and steps == list(range(1, len(steps) + 1))
    assert _toml(tmp_path / "t" / "config.toml")["train"]["steps"] == 100000


def test_a_fresh_start_moves_the_previous_run_aside_and_keeps_only_keep_old(corpus, tmp_path):
    """Before: resume=none deleted the previous run's metrics and never pruned the old checkpoints."""
    tree = _tree(corpus, tmp_path, train={"steps": 2}, checkpoint={"resume": "none", "keep_old": 2})
    run_dir, ids = tmp_path / "t", []
    for _ in range(4):
        run_ranks(_train, 1, (tree,))
        ids.append(read_run_id(run_dir / "checkpoints" / "step_000000002"))
    aside = sorted(run_dir.glob("old-*"))
    assert len(aside) == 2 and len(set(ids)) == 4  # the fourth start pruned the first run's folder
    for folder, run_id in zip(aside, ids[1:3]):  # each the whole previous run: metrics, config, checkpoints
        records = _records(folder)
        assert records[0]["run_id"] == run_id and [r["step"] for r in records if r["kind"] == "train"] == [2]
        assert (folder / "config.toml").is_file() and read_run_id(folder / "checkpoints" / "step_000000002") == run_id
    assert _records(run_dir)[0]["run_id"] == ids[3]
