"""The inner optimizers: Muon for hidden matrices + AdamW for the rest, as one checkpointable optimizer."""

from __future__ import annotations

import shutil

import torch

from tests.helpers import _train, tiny_overrides
from tests.multiproc import run_ranks
from zeroband.config import ModelConfig, OptimConfig
from zeroband.models.llama import Llama
from zeroband.optim import MuonAdamW, build_optimizer


def test_muon_takes_hidden_matrices_adamw_the_rest():
    model = Llama(ModelConfig(preset="debug"))
    named = list(model.named_parameters())
    opt = build_optimizer([p for _, p in named], OptimConfig(name="muon"), [n for n, _ in named])
    assert isinstance(opt, MuonAdamW)
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    for name, p in named:
        hidden = p.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name
        assert (id(p) in muon) == hidden, name
    # One set of groups: the scheduler's lr reaches both optimizers.
    for g in opt.param_groups:
        g["lr"] = 0.123
    assert {g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups} == {0.123}


def test_muon_run_resumes_exactly(corpus, tmp_path):
    """Interrupted at step 2 (its newest checkpoint) and resumed, a Muon run logs the same losses."""
    tree = tiny_overrides(corpus, tmp_path, optim={"name": "muon"}, train={"steps": 4},
                          checkpoint={"interval": 2, "keep_last": 5})
    full = run_ranks(_train, 1, (tree,))[0]
    ckpts = tmp_path / "t" / "checkpoints"
    shutil.rmtree(ckpts / "step_000000004")  # as if the run had died before its last save
    resumed = run_ranks(_train, 1, (tree,))[0]
    assert resumed["losses"] == full["losses"][2:]
    assert torch.isfinite(torch.tensor(full["losses"])).all()
