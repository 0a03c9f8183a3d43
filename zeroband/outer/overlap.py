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
                  nesterov: bool) -> torch.Tensor:
    """Where torch's SGD (dampening 0, no weight decay) would move `theta` with gradient `d`, leaving
    its state alone: buf' = momentum * buf + d; step = d + momentum * buf' (Nesterov) or buf'."""
    if momentum == 0:
        return theta - lr * d
    new_buf = d if buf is None else buf * momentum + d
    return theta - lr * (d + momentum * new_buf if nesterov else new_buf)


def estimate_weight(rule: str, sites: int) -> float | None:
    """How much of its own fresh pseudo-gradient a site previews while the average is in flight:
    "eager" all of it, "eager_share" its 1/n share, "delayed" none (no preview: None)."""
    return {"eager": 1.0, "eager_share": 1.0 / sites}.get(rule)


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
        snapshot = [t.detach().to("cpu", torch.float32, copy=True) for t in self.local]
        self.in_flight = _InFlight(grads, stats, self, snapshot)
        if previous is None:
            return None  # nothing applied yet: the first round's average is still in flight
        return self._stats(previous.result, previous.stats, previous.grads, waited, time.perf_counter() - t0, True)

    @torch.no_grad()
    def _land_in_flight(self, step: int) -> OuterStats | None:
        """overlap_steps = tau: apply the pending average tau inner steps after its launch."""
        if not self.cfg.overlap_steps or step + 1 - self.boundary_step < self.cfg.overlap_steps:
            return None
        t0, pending = time.perf_counter(), self.in_flight
        waited = self._complete_in_flight()
        return self._stats(pending.result, pending.stats, pending.grads, waited, time.perf_counter() - t0, True)

    def _move_to_estimate(self, fresh: list[torch.Tensor], weight: float) -> None:
        """Eager rules, step 5: local <- the outer step previewed on weight x this site's d_k."""
        group = self.optimizer.param_groups[0]
        for t, o, d in zip(self.local, self.outer, fresh):
            buf = self.optimizer.state.get(o, {}).get("momentum_buffer")
            est = d * weight if weight != 1.0 else d
            t.copy_(outer_preview(o, buf, est, group["lr"], group["momentum"], group["nesterov"]).to(t.device, t.dtype))

    def _complete_in_flight(self) -> float:
        """Wait for the pending average, apply it, and rebase local progress onto the new outer copy."""
        pending, self.in_flight = self.in_flight, None
        t0 = time.perf_counter()
        result = pending.wait(self.group)
        waited = time.perf_counter() - t0
        self._apply(pending.grads, result)
        for t, o, s in zip(self.local, self.outer, pending.snapshot):
            t.copy_((o + (t.detach().to("cpu", torch.float32) - s)).to(t.device, t.dtype))
        return waited
