"""A run directory says what really ran, belongs to one run at a time, and keeps what came before:
settings changed on resume are applied and said (or refused, naming the key), a second run with the
same name stops naming the first, and a fresh start moves the previous run aside instead of
deleting it. Pure rules in-process; the rest on real trainer processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_overrides
from zeroband.config import deep_merge, validate_config
from zeroband.resume_rules import config_changes, refusal, resume_rule
from zeroband.rundir import RunDirBusy, old_victims, run_dir_lock

pytestmark = pytest.mark.timeout(120)


def _tree(corpus: dict, out: Path, **extra: object) -> dict:
    base = {"train": {"steps": 4}, "checkpoint": {"interval": 2}, "optim": {"schedule": "constant", "warmup_steps": 0}}
    return tiny_overrides(corpus, out, **deep_merge(base, extra))


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
