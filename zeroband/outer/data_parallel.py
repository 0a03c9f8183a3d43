"""Per-step data parallel across sites: the baseline DiLoCo is measured against.

Every inner step, each rank's gradient shard is averaged over the sites on its global group before
the inner optimizer steps, so all sites take identical steps (the same maths as one big
data-parallel job, with the cross-site traffic on the same global groups DiLoCo uses).
Selected by `diloco.mode = "data_parallel"`; `diloco.inner_steps` then only sets how often the
communication totals are reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from zeroband.comm import codecs
from zeroband.comm.group import GlobalGroup
from zeroband.comm.reduce import describe_exclusions, reduce_across_sites
from zeroband.config import DilocoConfig
from zeroband.membership.base import agree_on_run
from zeroband.mesh import Topology
from zeroband.outer.base import OuterStats
from zeroband.outer.diloco import local_shard, site_stats
from zeroband.outer.replicas import broadcast_from_site0, verify_identical

log = logging.getLogger(__name__)


class CrossSiteDataParallel:
    def __init__(self, model: torch.nn.Module, cfg: DilocoConfig, topology: Topology, group: GlobalGroup) -> None:
        if codecs.spec(cfg.comm_dtype).feedback == "always":  # per-step gradients carry no residual between steps
            raise ValueError(f"diloco.comm_dtype = {cfg.comm_dtype!r} needs error feedback, which diloco.mode = "
                             "'data_parallel' does not carry: choose fp32, bf16, fp16, int8 or int4, or mode 'diloco'")
        self.cfg = cfg
        self.topology, self.group = topology, group
        self.params = list(model.parameters())
        self.window = {"comm_s": 0.0, "payload": 0, "wire": 0, "steps": 0}
        self.reports = 0

    def leave(self) -> None:
        pass

    def attach(self, sink: Callable[[dict[str, Any]], None]) -> None:
        pass

    def start(self, resumed: bool = False) -> None:
        agree_on_run(self.group, self.topology, self.topology.timeout_s)
        with torch.no_grad():
            local = [local_shard(p) for p in self.params]
            broadcast_from_site0(local, self.group, self.topology)
            verify_identical(local, self.group, self.topology, "initial broadcast")

    @torch.no_grad()
    def sync_gradients(self) -> None:
        t0 = time.perf_counter()
        shards = [local_shard(p.grad) if p.grad is not None else torch.zeros_like(local_shard(p)) for p in self.params]
        grads = [g.detach().to("cpu", torch.float32, copy=True) for g in shards]
        stats = site_stats(grads, self.topology)
        group = self.group
        result = group.watched(lambda: reduce_across_sites(grads, stats, group, self.cfg.comm_dtype,
                                                           int(self.cfg.piece_mb * 2**20)), "gradient all-reduce")
        if result.exclusions:  # the others' average stands in for their gradients this step
            log.error("gradient all-reduce: excluded %s", describe_exclusions(result.exclusions))
        for shard, g in zip(shards, grads):
            shard.copy_(g.to(shard.device, shard.dtype))
        self.window["comm_s"] += time.perf_counter() - t0
        self.window["payload"] += result.payload_bytes
        self.window["wire"] += result.wire_bytes
        self.window["steps"] += 1

    def finished(self, step: int, total_steps: int) -> bool:
        return step >= total_steps

    def run_step(self, step: int) -> int:  # rounds of inner_steps steps only: the site's step
        return step

    def after_inner_step(self, step: int, sync_point: bool = False) -> OuterStats | None:
        if step % self.cfg.inner_steps:
            return None
        self.reports += 1
        w, self.window = self.window, {"comm_s": 0.0, "payload": 0, "wire": 0, "steps": 0}
        return OuterStats(outer_step=self.reports, allreduce_s=w["comm_s"], outer_step_s=w["comm_s"],
                          payload_bytes=int(w["payload"]), wire_bytes=int(w["wire"]), pseudo_grad_norm=0.0,
                          avg_pseudo_grad_norm=0.0, outer_lr=0.0, sites_used=self.topology.world.site_count)

    def state_dict(self) -> dict[str, Any]:
        return {"reports": self.reports}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reports = state["reports"]
