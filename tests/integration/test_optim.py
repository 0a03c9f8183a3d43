"""The inner optimizers: Muon for hidden matrices + AdamW for the rest, as one checkpointable optimizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.helpers import _train, tiny_overrides
from tests.multiproc import run_ranks
from tests.unit import test_optim as unit_tier  # what both tiers share is defined there, once
from zeroband import optim
from zeroband.config import OptimConfig
from zeroband.optim import build_optimizer

KERNELS = unit_tier.KERNELS
_kernels = unit_tier._kernels
_step = unit_tier._step


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


def _resume_gpu_checkpoint_on_host(root: str) -> tuple[list[dict], bool]:
    """A checkpoint written by a fused AdamW, loaded by the trainer's loader into this run's optimizer."""
    from zeroband import checkpoint as ckpt
    from zeroband.mesh import init_topology, shutdown
    from zeroband.world import World

    init_topology(World(0, 1, 0, 0, 1, torch.device("cpu")), None, "kernel", 30, "gloo")
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 5)
        params, cfg = list(model.parameters()), OptimConfig(lr=1e-2)
        writer = torch.optim.AdamW(optim.adamw_groups(params, cfg), lr=cfg.lr, **KERNELS["gpu"])  # as on a GPU
        _step(model, writer, seed=1)
        path = ckpt.save_checkpoint(Path(root), 1, model, writer, {}, {}, keep_last=2)
        reader = build_optimizer(params, cfg)
        ckpt.load_checkpoint(ckpt.CheckpointInfo(path, 1, ckpt.verify_checkpoint(path)), model, reader, {})
        _step(model, reader, seed=2)
        return _kernels(reader), all(bool(torch.isfinite(p).all()) for p in model.parameters())
    finally:
        shutdown()


def test_checkpoint_loader_keeps_this_runs_adamw_kernel(tmp_path):
    """The same through the trainer's DCP load (set_state_dict), not only Optimizer.load_state_dict."""
    kernels, finite = run_ranks(_resume_gpu_checkpoint_on_host, 1, (str(tmp_path),), timeout=60)[0]
    assert kernels == [KERNELS["host"]] * 2 and finite
