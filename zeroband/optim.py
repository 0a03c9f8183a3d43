"""The inner optimizer and its learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.optim.lr_scheduler import LambdaLR

from zeroband.config import OptimConfig

# Not Muon's: the embedding and the output head are lookups/classifiers, not hidden transforms.
MUON_EXCLUDED = ("embed_tokens", "lm_head")


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig, names: list[str] | None = None) -> torch.optim.Optimizer:
    """The inner optimizer. `names` (the parameters' names, same order) is needed by "muon"."""
    if cfg.name == "muon":
        if names is None:
            raise ValueError("optim.name = 'muon' needs the parameter names")
        hidden = [p for n, p in zip(names, params) if p.ndim == 2 and not any(x in n for x in MUON_EXCLUDED)]
        taken = {id(p) for p in hidden}
        return MuonAdamW(hidden, adamw_groups([p for p in params if id(p) not in taken], cfg), cfg)
    groups = adamw_groups(params, cfg)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr)
    kernel = adamw_kernel(params)
    return keep_kernel(torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel), kernel)


def adamw_kernel(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """AdamW's implementation: fused on GPUs (one kernel launch for all parameters instead of about
    ten per tensor); elsewhere the single-tensor loop, whose per-parameter math is the same whatever
    the sharding (the 1 vs 2 rank test). Both are elementwise: sharding never changes a bit.
    Every kernel key is set, so `keep_kernel` can put all of them back after a load."""
    if params and all(p.is_cuda for p in params):
        return {"foreach": False, "fused": True}
    return {"foreach": False, "fused": False}


OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


def keep_kernel(optimizer: OptimizerT, kernel: dict[str, bool]) -> OptimizerT:
    """Make `optimizer.load_state_dict` keep this run's kernel. Why: torch restores the saved param
    groups' `fused`/`foreach`, so a GPU checkpoint (fused) resumed on a CPU, or a CPU one resumed on a
    GPU (the slow single-tensor loop), would silently run the other kernel. Only the groups built
    with a kernel (that carry its keys now: AdamW's, not Muon's) are rewritten; the caller's dict is
    not changed. Rewritten before torch reads the groups, so the `step` counters land where the
    kept kernel wants them (the device for fused, the host otherwise)."""

    def rewrite(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        groups = [{**saved, **kernel} if kernel.keys() <= mine.keys() else saved
                  for mine, saved in zip(opt.param_groups, state_dict["param_groups"])]
        # (a group count mismatch is left to load_state_dict, which raises with its own message)
        return {**state_dict, "param_groups": groups}

    optimizer.register_load_state_dict_pre_hook(rewrite)
    return optimizer


def adamw_groups(params: list[torch.nn.Parameter], cfg: OptimConfig) -> list[dict]:
    # Norm weights and other 1-D parameters are not decayed (standard for Llama pretraining).
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the hidden 2-D weights and AdamW for the rest, as ONE optimizer.

    Why one: the LR scheduler, gradient clipping and DCP checkpoints (get/set_state_dict) all take a
    single optimizer. The two torch optimizers do the arithmetic; this object owns the param groups
    and the state and points both at them (again after load_state_dict, which rebuilds both).
    Muon's lr is matched to AdamW's update RMS (adjust_lr_fn="match_rms_adamw"), so one optim.lr and
    one schedule serve both.
    """

    def __init__(self, hidden: list[torch.nn.Parameter], adamw: list[dict], cfg: OptimConfig) -> None:
        self.muon = torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                                     adjust_lr_fn="match_rms_adamw")
        kernel = adamw_kernel([p for group in adamw for p in group["params"]])
        self.adamw = torch.optim.AdamW(adamw, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._link()
        keep_kernel(self, kernel)  # on this object: its load_state_dict is the one checkpoints call

    def _link(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self.muon.step()
        self.adamw.step()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()


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


def follow_schedule(scheduler: LambdaLR, position: int) -> None:
    """Put the schedule at `position` (the next step's 0-based index): the run step
    (`Outer.run_step`); a no-op while it already is there, as in every run with rounds of
    inner_steps steps."""
    if scheduler.last_epoch != position:
        scheduler.last_epoch = position - 1
        scheduler.step()


@contextmanager
def hyperparameters_kept(optimizer: torch.optim.Optimizer, scheduler: LambdaLR | None = None) -> Iterator[None]:
    """Load a checkpoint inside this and the optimizer keeps the hyperparameters it was built with
    (this run's config), the scheduler this run's base lr; the lr is then recomputed at the loaded
    step. Why: `optimizer.load_state_dict` restores every group's saved lr, betas, weight decay,
    kernel..., and `LambdaLR.load_state_dict` its saved base lrs, so a resume with a new `optim.lr`
    would silently train on with the old one. The schedule's shape (steps, warmup, decay) is this
    run's already: LambdaLR never saves a plain function."""
    mine = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    yield
    for group, settings in zip(optimizer.param_groups, mine, strict=True):
        group.update(settings)
    if scheduler is not None:
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
