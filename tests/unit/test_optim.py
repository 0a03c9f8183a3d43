"""The inner optimizers: Muon for hidden matrices + AdamW for the rest, as one checkpointable optimizer."""

from __future__ import annotations

import copy

import pytest
import torch

from zeroband import optim
from zeroband.config import ModelConfig, OptimConfig
from zeroband.models.llama import Llama
from zeroband.optim import MuonAdamW, build_optimizer

# The two AdamW kernels a run can pick (optim.adamw_kernel): all-GPU parameters, and the rest.
KERNELS = {"gpu": {"foreach": False, "fused": True}, "host": {"foreach": False, "fused": False}}


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


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step on fixed pseudo-random gradients (the same for every caller with `seed`)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _saved_with(opt: torch.optim.Optimizer, kernel: dict[str, bool]) -> dict:
    """opt's state dict as a run on the other kind of device wrote it: its AdamW groups carry `kernel`."""
    state = copy.deepcopy(opt.state_dict())
    for group in state["param_groups"]:
        if "fused" in group:
            group.update(kernel)
    return state


def _kernels(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: g[k] for k in ("foreach", "fused")} for g in opt.param_groups if "fused" in g]


@pytest.mark.parametrize("mine, theirs", [("host", "gpu"), ("gpu", "host")])
def test_resume_keeps_this_runs_adamw_kernel(monkeypatch, mine, theirs):
    """A checkpoint written with the other kernel loads with this run's, and the run goes on exactly
    as if it had never stopped. (fused=True runs on CPU tensors too: it stands in for a GPU run.)"""
    monkeypatch.setattr(optim, "adamw_kernel", lambda params: KERNELS[mine])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    opt = build_optimizer(list(model.parameters()), OptimConfig(lr=1e-2))
    _step(model, opt, seed=1)
    saved = _saved_with(opt, KERNELS[theirs])
    twin = copy.deepcopy(model)
    twin_opt = build_optimizer(list(twin.parameters()), OptimConfig(lr=1e-2))
    twin_opt.load_state_dict(saved)
    assert _kernels(twin_opt) == [KERNELS[mine]] * 2
    assert all(g["fused"] == KERNELS[theirs]["fused"] for g in saved["param_groups"])  # the caller's dict untouched
    for seed in (2, 3):
        _step(model, opt, seed)
        _step(twin, twin_opt, seed)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_resume_keeps_the_muon_runs_adamw_kernel():
    """The hybrid: its AdamW groups keep this run's kernel, Muon's groups get no kernel keys."""
    model = Llama(ModelConfig(preset="debug"))
    named = list(model.named_parameters())
    opt = build_optimizer([p for _, p in named], OptimConfig(name="muon"), [n for n, _ in named])
    _step(model, opt, seed=1)
    twin = copy.deepcopy(model)
    twin_opt = build_optimizer(list(twin.parameters()), OptimConfig(name="muon"), [n for n, _ in twin.named_parameters()])
    twin_opt.load_state_dict(_saved_with(opt, KERNELS["gpu"]))
    assert _kernels(twin_opt) == [KERNELS["host"]] * 2 == _kernels(twin_opt.adamw)  # still linked
    assert not any("fused" in g for g in twin_opt.muon.param_groups)
    _step(model, opt, seed=2)
    _step(twin, twin_opt, seed=2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
