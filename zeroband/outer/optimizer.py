"""The outer optimizer: any `torch.optim.Optimizer` over DiLoCo's fp32 outer copy, as torchft takes it.

`choose(cfg)` turns [diloco] into an `OptimizerChoice` (a pure function: which torch class, which
settings); `build_outer_optimizer` makes the `OuterOptimizer` that steps the outer copy:
- `NesterovSGD`: torch's SGD (Nesterov or heavy-ball, no dampening or weight decay: what
  `outer_optimizer = "nesterov" | "sgd"` builds) through the native kernel of outer/sgd.c, which
  writes the local shard in the same pass, bit for bit torch's fused SGD (outer/sgd_kernel.py);
- `TorchOuter`: any other optimizer: the average goes into the outer copy's `.grad`, then
  `optimizer.step()`; the local shard takes the outer copy afterwards.
Either way the torch optimizer holds the state, so checkpoints read the same.

Per step the schedule (`OuterSchedule`) gives the lr factor (`outer_lr_schedule = "inner"`) and, for
SGD, the momentum warm-up (`outer_momentum_warmup`); the step takes them as arguments (`OuterHyper`)
instead of reading them back from the optimizer's param_groups. The eager overlap rules move the
working model by a preview of the step (`preview`): SGD's is exact and cheap; other optimizers do
not preview (`can_preview` False), so they run with `overlap_rule = "delayed"`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zeroband.comm.timing import Parts
from zeroband.config import SGD_OUTER, DilocoConfig
from zeroband.optim import hyperparameters_kept
from zeroband.outer import sgd_kernel
from zeroband.outer.placement import OuterCopy

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
NAMED = {"nesterov": torch.optim.SGD, "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


@dataclass(frozen=True)
class OuterHyper:
    """One outer step's schedule: the lr multiplier and SGD's momentum multiplier (1.0: as configured)."""

    lr_scale: float = 1.0
    momentum_scale: float = 1.0


class OuterSchedule:
    """Outer step k's lr factor (`outer_lr_schedule = "inner"`: the inner schedule's factor at the
    boundary) and momentum ramp (from 0 over `outer_momentum_warmup` outer steps)."""

    def __init__(self, cfg: DilocoConfig, lr_factor: Callable[[int], float] | None = None) -> None:
        self.follow_inner, self.warmup = cfg.outer_lr_schedule == "inner", cfg.outer_momentum_warmup
        self.lr_factor = lr_factor or (lambda step: 1.0)

    def at(self, outer_step: int, boundary_step: int) -> OuterHyper:
        """Outer step `outer_step` + 1, at the boundary after inner step `boundary_step` (1-based)."""
        lr = self.lr_factor(boundary_step - 1) if self.follow_inner else 1.0
        return OuterHyper(lr, min(1.0, (outer_step + 1) / self.warmup) if self.warmup else 1.0)


def outer_hyperparameters(cfg: DilocoConfig, outer_step: int, inner_factor: float) -> tuple[float, float]:
    """Outer lr and momentum of outer step `outer_step` + 1 with the configured SGD (what `NesterovSGD`
    computes from `OuterSchedule`): outer_lr x the inner factor, momentum ramped over the warm-up."""
    hyper = OuterSchedule(cfg, lambda step: inner_factor).at(outer_step, 1)
    return cfg.outer_lr * hyper.lr_scale, cfg.outer_momentum * hyper.momentum_scale


# ---------------------------------------------------------------------------------------------- choice
@dataclass(frozen=True)
class OptimizerChoice:
    """Which torch optimizer the config asks for, with its settings (hashable: a pure function's value)."""

    cls: type[torch.optim.Optimizer]
    settings: tuple[tuple[str, Any], ...]

    def make(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return self.cls(params, **dict(self.settings))


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """A short name (NAMED) or a torch optimizer's dotted name ("torch.optim.RAdam"); ValueError else.
    Only torch.optim: a config names no other code to import and run."""
    if name in NAMED:
        return NAMED[name]
    module, _, attr = name.rpartition(".")
    found = getattr(importlib.import_module(module), attr, None) if module.startswith("torch.optim") else None
    if not (inspect.isclass(found) and issubclass(found, torch.optim.Optimizer)):
        raise ValueError(f"diloco.outer_optimizer={name!r} is not an outer optimizer: use one of "
                         f"{', '.join(NAMED)} or a torch optimizer's dotted name such as 'torch.optim.RAdam'")
    return found


def choose(cfg: DilocoConfig) -> OptimizerChoice:
    """The outer optimizer that [diloco] describes: a pure function of the config."""
    cls = optimizer_class(cfg.outer_optimizer)
    settings: dict[str, Any] = {"lr": cfg.outer_lr}
    if cfg.outer_optimizer in SGD_OUTER:  # fused: torch's kernel, whose bits the native one reproduces
        nesterov = cfg.outer_optimizer == "nesterov" and cfg.nesterov and cfg.outer_momentum > 0
        settings |= {"momentum": cfg.outer_momentum, "nesterov": nesterov, "fused": True}
    settings |= {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.outer_kwargs.items()}
    return OptimizerChoice(cls, tuple(sorted(settings.items())))


def is_plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is the SGD that `NesterovSGD` implements: torch's SGD, one group, no
    dampening, weight decay or maximize (what its native kernel computes)."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return False
    g = optimizer.param_groups[0]
    return g["dampening"] == 0 and g["weight_decay"] == 0 and not g["maximize"]


def build_outer_optimizer(copy: OuterCopy, cfg: DilocoConfig,
                          factory: OptimizerFactory | None = None) -> OuterOptimizer:
    """The outer optimizer over `copy.tensors`: `factory`'s if given, else the config's (`choose`);
    the native path wherever the optimizer is the plain SGD it implements."""
    optimizer = (factory or choose(cfg).make)(copy.tensors)
    outer = NesterovSGD(optimizer) if is_plain_sgd(optimizer) else TorchOuter(optimizer)
    if cfg.overlap and cfg.overlap_rule != "delayed" and not outer.can_preview:
        raise ValueError(f"diloco.overlap_rule={cfg.overlap_rule!r} previews the outer step, which "
                         f"{type(optimizer).__name__} cannot: set diloco.overlap_rule = 'delayed'")
    return outer


# ---------------------------------------------------------------------------------------------- the two paths
class OuterOptimizer:
    """Steps the outer copy with the average; the torch optimizer it wraps holds the state."""

    can_preview = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.applied = OuterHyper()  # the schedule of the last step: a preview moves by it
        self.applied_lr = self.base_lrs[0]  # the lr of the last step (metrics)

    def step(self, copy: OuterCopy, grads: list[torch.Tensor], hyper: OuterHyper, parts: Parts,
             into_local: bool) -> None:
        """outer <- the optimizer's step with `grads` (on the outer copy's device) and schedule `hyper`;
        `into_local`: the local shard takes the new outer copy."""
        self.applied, self.applied_lr = hyper, self._step(copy, grads, hyper, parts, into_local)

    def _step(self, copy: OuterCopy, grads: list[torch.Tensor], hyper: OuterHyper, parts: Parts,
              into_local: bool) -> float:
        """The step; returns the lr it used."""
        raise NotImplementedError

    def preview(self, theta: torch.Tensor, d: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """Into `out`: where a step with gradient `d`, on the last step's schedule, would move outer
        tensor `theta`, leaving the state alone (`scratch`: memory like theta that it may use)."""
        raise NotImplementedError(f"{type(self.optimizer).__name__} has no preview of its step")

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's tensor state, in parameter order: every site must hold it bitwise alike
        (1-D views: a step count is a 0-d tensor, which the replica digest cannot read as bytes)."""
        return [v.reshape(-1) for g in self.optimizer.param_groups for p in g["params"]
                for v in self.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with hyperparameters_kept(self.optimizer):  # a resume's new settings apply
            self.optimizer.load_state_dict(state)


class TorchOuter(OuterOptimizer):
    """Any torch optimizer: the average as the outer copy's gradient, then `optimizer.step()`."""

    def _step(self, copy: OuterCopy, grads: list[torch.Tensor], hyper: OuterHyper, parts: Parts,
              into_local: bool) -> float:
        with parts("optimizer"):
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base * hyper.lr_scale  # what an LR scheduler does: torch reads it there
            for o, g in zip(copy.tensors, grads):
                o.grad = g
            self.optimizer.step()
            for o in copy.tensors:
                o.grad = None
        if into_local:
            with parts("h2d"):
                copy.to_local()
        return self.optimizer.param_groups[0]["lr"]


class NesterovSGD(OuterOptimizer):
    """torch's SGD (Nesterov or not) through outer/sgd.c: torch's bits, the local shard in the same pass."""

    can_preview = True

    def hyper(self, hyper: OuterHyper) -> tuple[float, float, bool]:
        group = self.optimizer.param_groups[0]
        return group["lr"] * hyper.lr_scale, group["momentum"] * hyper.momentum_scale, group["nesterov"]

    def _step(self, copy: OuterCopy, grads: list[torch.Tensor], hyper: OuterHyper, parts: Parts,
              into_local: bool) -> float:
        lr, momentum, nesterov = self.hyper(hyper)
        together = into_local and not any(t.is_cuda for t in copy.local) and copy.device.type == "cpu"
        state = self.optimizer.state
        with parts("optimizer"):
            for o, g, t in zip(copy.tensors, grads, copy.local):
                local = t.view(-1) if together and t.is_contiguous() else None
                kept = state.get(o, {}).get("momentum_buffer")  # .get: no empty state, as torch
                buf = sgd_kernel.sgd(o.view(-1), g.reshape(-1), None if kept is None else kept.view(-1), local, lr,
                                     momentum, nesterov, copy.stream)
                if buf is not None:
                    state[o]["momentum_buffer"] = buf.view(o.shape)
                if together and local is None:
                    t.copy_(o)
        if into_local and not together:
            with parts("h2d"):
                copy.to_local()
        return lr

    def preview(self, theta: torch.Tensor, d: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        lr, momentum, nesterov = self.hyper(self.applied)
        buf = self.optimizer.state.get(theta, {}).get("momentum_buffer")
        return sgd_preview(theta, buf, d, lr, momentum, nesterov, out, scratch)


def sgd_preview(theta: torch.Tensor, buf: torch.Tensor | None, d: torch.Tensor, lr: float, momentum: float,
                nesterov: bool, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Where torch's SGD (dampening 0, no weight decay) would move `theta` with gradient `d`, leaving
    its state alone: buf' = momentum * buf + d; step = d + momentum * buf' (Nesterov) or buf'.
    Written into `out`, with `scratch` for buf' (both like theta, aliasing none of the inputs;
    fresh when not given): the same operations in the same order as the formulas, so the same bits
    (additions commute exactly), without a full-size temporary per operation."""
    out = torch.empty_like(theta) if out is None else out
    if momentum == 0:
        return torch.sub(theta, torch.mul(d, lr, out=out), out=out)
    if buf is None:
        new_buf = d
    else:
        new_buf = torch.mul(buf, momentum, out=torch.empty_like(theta) if scratch is None else scratch).add_(d)
    step = torch.mul(new_buf, momentum, out=out).add_(d) if nesterov else out.copy_(new_buf)
    return torch.sub(theta, step.mul_(lr), out=out)
