"""The overlapped outer step (`diloco.overlap = true`) and its rules; see zeroband/outer/diloco.py.

`OverlapRules` is the part of `DiLoCo` that runs while an average is in flight: launching it on a
background thread, moving the working model by an estimate ("eager", "eager_share"), landing the
average tau inner steps later or at the next boundary, and rebasing local progress onto it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from zeroband.comm.group import GlobalGroup
from zeroband.comm.reduce import ReduceResult, SiteStats
from zeroband.outer.base import OuterStats
from zeroband.outer.stats import site_stats

if TYPE_CHECKING:
    from zeroband.outer.diloco import DiLoCo


class _InFlight:
    """A pseudo-gradient all-reduce running on a background thread (global group only)."""

    def __init__(self, grads: list[torch.Tensor], stats: SiteStats, diloco: DiLoCo, snapshot: list[torch.Tensor]):
        self.grads, self.stats, self.snapshot = grads, stats, snapshot  # grads become the average in place
        self.result: ReduceResult | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(diloco,), name="zeroband-outer-allreduce", daemon=True)
        self.thread.start()

    def _run(self, diloco: DiLoCo) -> None:
        try:
            self.result = diloco.reduce(self.grads, self.stats)
        except BaseException as e:  # re-raised on the main thread by wait()
            self.error = e

    def wait(self, group: GlobalGroup) -> ReduceResult:
        group.watch.join(self.thread, "overlapped outer all-reduce")
        if self.error is not None:
            raise self.error
        return self.result



def outer_preview(theta: torch.Tensor, buf: torch.Tensor | None, d: torch.Tensor, lr: float, momentum: float,
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


def estimate_weight(rule: str, sites: int) -> float | None:
    """How much of its own fresh pseudo-gradient a site previews while the average is in flight:
    "eager" all of it, "eager_share" its 1/n share, "delayed" none (no preview: None)."""
    return {"eager": 1.0, "eager_share": 1.0 / sites}.get(rule)


def in_place_ok(t: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether the local shard `t` can take the host fp32 arithmetic of `like` directly."""
    return t.device == like.device and t.dtype == like.dtype and t.is_contiguous()


class Scratch:
    """Memory the overlapped boundary reuses: a few vectors as long as the largest tensor, and the
    snapshot of the local shard (one at a time: the previous one is landed before the next is taken)."""

    def __init__(self) -> None:
        self.flat: dict[int, torch.Tensor] = {}
        self.kept: list[torch.Tensor] = []

    def take(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """Room shaped like `like` (fp32, its device) in reused vector `slot`."""
        have = self.flat.get(slot)
        if have is None or have.numel() < like.numel() or have.device != like.device:
            have = self.flat[slot] = torch.empty(like.numel(), dtype=torch.float32, device=like.device)
        return have[: like.numel()].view(like.shape)

    def snapshot(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host fp32 copies of `local`, in memory kept from the last snapshot."""
        if [k.shape for k in self.kept] != [t.shape for t in local]:
            self.kept = [torch.empty(t.shape, dtype=torch.float32) for t in local]
        return [k.copy_(t.detach()) for k, t in zip(self.kept, local)]


class OverlapRules:
    """Mixed into `DiLoCo`: the overlapped boundary (it uses DiLoCo's optimizer, copies and reduce)."""

    @torch.no_grad()
    def _overlapped_boundary(self) -> OuterStats | None:
        t0 = time.perf_counter()
        previous = self.in_flight
        waited = self._complete_in_flight() if previous else 0.0
        grads = self.pseudo_gradient()
        stats = site_stats(grads, self.topology, self.clock.take_tokens(), local=self.copy.stats_of(grads))
        weight = estimate_weight(self.cfg.overlap_rule, self.group.size)
        if weight is not None:
            self._move_to_estimate(grads, weight)
        self.in_flight = _InFlight(grads, stats, self, self.scratch.snapshot(self.local))
        if previous is None:
            return None  # nothing applied yet: the first round's average is still in flight
        return self._stats(previous.result, previous.stats, previous.grads, waited, time.perf_counter() - t0, True)

    @torch.no_grad()
    def _land_in_flight(self, step: int) -> OuterStats | None:
        """overlap_steps = tau: apply the pending average tau inner steps after its launch."""
        if not self.cfg.overlap_steps or step - self.boundary_step < self.cfg.overlap_steps:
            return None
        t0, pending = time.perf_counter(), self.in_flight
        waited = self._complete_in_flight()
        return self._stats(pending.result, pending.stats, pending.grads, waited, time.perf_counter() - t0, True)

    def _move_to_estimate(self, fresh: list[torch.Tensor], weight: float) -> None:
        """Eager rules, step 5: local <- the outer step previewed on weight x this site's d_k. In reused
        scratch memory (or straight into a host fp32 shard): a fresh temporary per operation was a page
        fault per 4 KB, most of the overlapped boundary's time."""
        group = self.optimizer.param_groups[0]
        for t, o, d in zip(self.local, self.outer, fresh):
            buf = self.optimizer.state.get(o, {}).get("momentum_buffer")
            est = torch.mul(d, weight, out=self.scratch.take(0, o)) if weight != 1.0 else d
            out = t if in_place_ok(t, o) else self.scratch.take(1, o)
            outer_preview(o, buf, est, group["lr"], group["momentum"], group["nesterov"], out, self.scratch.take(2, o))
            if out is not t:
                t.copy_(out)

    def _complete_in_flight(self) -> float:
        """Wait for the pending average, apply it, and rebase local progress onto the new outer copy."""
        pending, self.in_flight = self.in_flight, None
        t0 = time.perf_counter()
        result = pending.wait(self.group)
        waited = time.perf_counter() - t0
        self._apply(pending.grads, result)
        for t, o, s in zip(self.local, self.outer, pending.snapshot):  # t <- o + (t - s), same bits as the formula
            if in_place_ok(t, o):
                t.sub_(s).add_(o)
            else:
                t.copy_(self.scratch.take(0, o).copy_(t).sub_(s).add_(o))
        return waited
