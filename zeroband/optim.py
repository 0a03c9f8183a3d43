"""The inner optimizer and its learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from zeroband.config import OptimConfig


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    # Norm weights and other 1-D parameters are not decayed (standard for Llama pretraining).
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr)
    # foreach=False keeps per-parameter math identical whatever the sharding (1 vs 2 ranks).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of the base lr at `step` (0-based): linear warmup, then the chosen shape."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # warmup-stable-decay: flat, then a linear decay over the last decay_fraction of the run
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    return floor + (1 - floor) * max(0.0, (total_steps - step) / decay_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))
