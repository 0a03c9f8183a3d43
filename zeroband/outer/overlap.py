"""The overlapped outer step (`diloco.overlap = true`) and its rules; see zeroband/outer/diloco.py.

`Overlap` is an object with its own state: the average in flight (launched on a background thread,
with the snapshot of the local shard taken at its launch) and the memory it reuses. It moves the
working model by an estimate while the average is in flight ("eager", "eager_share": a preview that
the outer optimizer computes), and lands the average tau inner steps later or at the next boundary,
rebasing local progress onto it. What it needs from the outer step is handed to it: the local
shard, the outer copy, the outer optimizer, and the reduce / apply functions of each call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from zeroband.comm.group import GlobalGroup
from zeroband.comm.reduce import ReduceResult, SiteStats
from zeroband.config import DilocoConfig
from zeroband.outer.optimizer import OuterOptimizer
from zeroband.outer.placement import OuterCopy

Reduce = Callable[[list[torch.Tensor], SiteStats], ReduceResult]  # the average of a pseudo-gradient, in place


class InFlight:
    """A pseudo-gradient all-reduce running on a background thread (global group only)."""

    def __init__(self, grads: list[torch.Tensor], stats: SiteStats, reduce: Reduce, snapshot: list[torch.Tensor]):
        self.grads, self.stats, self.snapshot = grads, stats, snapshot  # grads become the average in place
        self.result: ReduceResult | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(reduce,), name="zeroband-outer-allreduce", daemon=True)
        self.thread.start()

    def _run(self, reduce: Reduce) -> None:
        try:
            self.result = reduce(self.grads, self.stats)
        except BaseException as e:  # re-raised on the main thread by wait()
            self.error = e

    def wait(self, group: GlobalGroup) -> ReduceResult:
        group.watch.join(self.thread, "overlapped outer all-reduce")
        if self.error is not None:
            raise self.error
        assert self.result is not None, "the joined reduce neither returned nor raised"
        return self.result


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


class Overlap:
    """The overlapped outer step's state and rules (steps 1-5 of zeroband/outer/diloco.py's docstring)."""

    def __init__(self, cfg: DilocoConfig, local: list[torch.Tensor], copy: OuterCopy, optimizer: OuterOptimizer) -> None:
        self.rule, self.tau = cfg.overlap_rule, cfg.overlap_steps
        self.local, self.copy, self.optimizer = local, copy, optimizer
        self.pending: InFlight | None = None
        self.launched_at = 0  # inner steps done when the pending average was launched
        self.scratch = Scratch()

    def due(self, step: int) -> bool:
        """overlap_steps = tau: the pending average lands tau inner steps after its launch (`step`
        and `launched_at` count inner steps done)."""
        return self.pending is not None and bool(self.tau) and step - self.launched_at >= self.tau

    def launch(self, grads: list[torch.Tensor], stats: SiteStats, sites: int, reduce: Reduce, step: int) -> None:
        """Steps 4-5: the eager rules move the local shard to the estimate, then the average of `grads`
        starts on a background thread, with a snapshot of the local shard to rebase onto later."""
        weight = estimate_weight(self.rule, sites)
        if weight is not None:
            self._move_to_estimate(grads, weight)
        self.pending, self.launched_at = InFlight(grads, stats, reduce, self.scratch.snapshot(self.local)), step

    def land(self, group: GlobalGroup, apply: Callable[[list[torch.Tensor], ReduceResult], None]) -> tuple[InFlight, float]:
        """Steps 1-3: wait for the pending average, `apply` it to the outer copy, and rebase local
        progress onto the new outer copy. Returns the landed exchange and the seconds waited for it."""
        pending, self.pending = self.pending, None
        assert pending is not None, "land() needs an average in flight (check `pending` first)"
        t0 = time.perf_counter()
        pending.result = pending.wait(group)
        waited = time.perf_counter() - t0
        apply(pending.grads, pending.result)
        outer = self.copy.tensors
        for t, o, s in zip(self.local, outer, pending.snapshot):  # t <- o + (t - s), same bits as the formula
            if in_place_ok(t, o):
                t.sub_(s).add_(o)
            else:
                t.copy_(self.scratch.take(0, o).copy_(t).sub_(s).add_(o))
        return pending, waited

    def _move_to_estimate(self, fresh: list[torch.Tensor], weight: float) -> None:
        """Eager rules, step 5: local <- the outer step previewed on weight x this site's d_k. In reused
        scratch memory (or straight into a host fp32 shard): a fresh temporary per operation was a page
        fault per 4 KB, most of the overlapped boundary's time (docs/results/outer_step.md)."""
        for t, o, d in zip(self.local, self.copy.tensors, fresh):
            est = torch.mul(d, weight, out=self.scratch.take(0, o)) if weight != 1.0 else d
            out = t if in_place_ok(t, o) else self.scratch.take(1, o)
            self.optimizer.preview(o, est, out, self.scratch.take(2, o))
            if out is not t:
                t.copy_(out)
