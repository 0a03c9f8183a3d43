"""DiLoCo's outer loop (Douillard et al. 2023) for one rank's shard.

Contract:
- build after the model is sharded and initialised; call `start()` once, which makes every site
  hold site 0's parameters (broadcast, then verified by checksum);
- call `after_inner_step(step)` after every inner optimizer step; every `inner_steps` steps it
  runs one outer step and returns its `OuterStats`, otherwise it returns None;
- an outer step: pseudo-gradient = outer copy - local shard (fp32, CPU), averaged over the sites
  on this rank's global group, applied by the outer optimizer (SGD, Nesterov by default) to the
  CPU fp32 outer copy, which is then copied back into the local shard. All sites end bitwise
  identical: they receive the same all-reduce bytes and run the same CPU arithmetic.
- a site whose pseudo-gradient holds NaN/inf is excluded from the average on every site alike
  (the sites exchange per-site statistics before the payload) and the exclusion is reported.

`SingleSite` has the same interface and does nothing, so the training loop has no DiLoCo branches.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zeroband.comm.dense import all_reduce_weighted
from zeroband.config import DilocoConfig
from zeroband.faults import maybe_inject
from zeroband.mesh import Topology

log = logging.getLogger(__name__)


def local_shard(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor this rank owns: the local shard of an FSDP2 DTensor, or the tensor itself."""
    data = param.data
    return data.to_local() if isinstance(data, DTensor) else data


@dataclass
class OuterStats:
    outer_step: int
    allreduce_s: float
    outer_step_s: float
    payload_bytes: int  # bytes this rank put into the all-reduce
    wire_bytes_est: int  # what a ring all-reduce sends per rank: 2(S-1)/S x payload
    pseudo_grad_norm: float  # this site's, before averaging
    avg_pseudo_grad_norm: float  # of the averaged pseudo-gradient
    outer_lr: float
    sites_used: int
    excluded_sites: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def contributing_sites(table: torch.Tensor) -> list[bool]:
    """Which sites' pseudo-gradients enter the average. Columns: sumsq, nonfinite count, max |g|.

    A site is excluded when any of its values is NaN/inf. (The decision depends only on the table,
    which is identical on every site, so every site decides the same.)
    """
    nonfinite = table[:, 1]
    return [bool(n == 0 and torch.isfinite(table[s, 0])) for s, n in enumerate(nonfinite)]


class SingleSite:
    """No outer loop: a plain one-site run."""

    def start(self) -> None:
        pass

    def after_inner_step(self, step: int) -> OuterStats | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class DiLoCo:
    def __init__(self, model: torch.nn.Module, cfg: DilocoConfig, topology: Topology) -> None:
        if topology.global_group is None:
            raise ValueError("DiLoCo needs a global group; build the topology with a store address")
        self.cfg = cfg
        self.topology = topology
        self.group = topology.global_group
        self.local = [local_shard(p) for p in model.parameters()]
        self.outer = [t.detach().to("cpu", torch.float32, copy=True) for t in self.local]
        self.optimizer = torch.optim.SGD(
            self.outer, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov and cfg.outer_momentum > 0
        )
        self.outer_step = 0

    # ------------------------------------------------------------------ start: identical replicas
    @torch.no_grad()
    def start(self) -> None:
        """Every site takes site 0's parameters, then all sites prove they agree by checksum."""
        for t in self.local:
            buf = t.detach().to("cpu", torch.float32, copy=True)
            self.group.broadcast(buf, src=0)
            t.copy_(buf)
        self._reset_outer_from_local()
        self.verify_identical("initial broadcast")

    def _reset_outer_from_local(self) -> None:
        for o, t in zip(self.outer, self.local):
            o.copy_(t.detach().to("cpu", torch.float32))

    def checksum(self) -> int:
        """crc32 of this rank's outer parameters and outer momentum, as bytes."""
        crc = 0
        for o in self.outer:
            crc = zlib.crc32(o.numpy().tobytes(), crc)
            buf = self.optimizer.state.get(o, {}).get("momentum_buffer")
            if buf is not None:
                crc = zlib.crc32(buf.numpy().tobytes(), crc)
        return crc

    def verify_identical(self, when: str) -> None:
        table = self.group.gather_scalars([float(self.checksum())])
        mismatch = torch.tensor([float(len(set(table[:, 0].tolist())) > 1)], device=self.topology.world.device)
        self.topology.site_all_reduce(mismatch, op=dist.ReduceOp.MAX)
        if mismatch.item():
            raise RuntimeError(
                f"sites disagree after {when}: checksums of shard {self.topology.world.rank} per site are "
                f"{[int(c) for c in table[:, 0].tolist()]}"
            )

    # ------------------------------------------------------------------ the outer step
    def after_inner_step(self, step: int) -> OuterStats | None:
        if (step + 1) % self.cfg.inner_steps:
            return None
        return self.sync(step + 1)

    @torch.no_grad()
    def sync(self, step: int = 0) -> OuterStats:
        """One outer step; `step` (inner steps done) only labels injected faults."""
        t0 = time.perf_counter()
        grads = [o - t.detach().to("cpu", torch.float32) for o, t in zip(self.outer, self.local)]
        table = self._exchange_site_stats(grads)
        use = contributing_sites(table)
        n = sum(use)
        excluded = [s for s, ok in enumerate(use) if not ok]
        if excluded:
            log.error("outer step %d: excluding sites %s (non-finite pseudo-gradient)", self.outer_step, excluded)
        weight = 1.0 / n if n and use[self.group.rank] else 0.0
        if weight == 0.0:
            grads = [torch.zeros_like(g) for g in grads]  # never send NaN/inf: it would poison the sum
        max_abs = max((table[s, 2].item() for s in range(len(use)) if use[s]), default=0.0)
        world = self.topology.world
        maybe_inject("allreduce", step, world.site_rank, world.rank)
        t1 = time.perf_counter()
        payload = all_reduce_weighted(grads, self.group, self.cfg.comm_dtype, weight, self._bucket_bytes, max_abs)
        t2 = time.perf_counter()
        if n:
            for o, g in zip(self.outer, grads):
                o.grad = g
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.outer_step += 1
        for t, o in zip(self.local, self.outer):
            t.copy_(o.to(t.device, t.dtype))
        size = self.group.size
        return OuterStats(
            outer_step=self.outer_step,
            allreduce_s=t2 - t1,
            outer_step_s=time.perf_counter() - t0,
            payload_bytes=payload,
            wire_bytes_est=int(payload * 2 * (size - 1) / size),
            pseudo_grad_norm=float(table[self.group.rank, 0].sqrt()),
            avg_pseudo_grad_norm=self._site_norm(grads),
            outer_lr=self.optimizer.param_groups[0]["lr"],
            sites_used=n,
            excluded_sites=excluded,
        )

    @property
    def _bucket_bytes(self) -> int:
        return int(self.cfg.bucket_mb * 2**20)

    def _exchange_site_stats(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """[sites, 3] table of (sum of squares, non-finite count, max |g|) over each whole site."""
        sumsq = sum((g.double().square().sum() for g in grads), torch.zeros((), dtype=torch.float64))
        nonfinite = sum(int((~torch.isfinite(g)).sum()) for g in grads)
        max_abs = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
        device = self.topology.world.device
        summed = torch.tensor([float(sumsq), float(nonfinite)], dtype=torch.float64, device=device)
        self.topology.site_all_reduce(summed)
        peak = torch.tensor([max_abs], dtype=torch.float64, device=device)
        self.topology.site_all_reduce(peak, op=dist.ReduceOp.MAX)
        return self.group.gather_scalars([summed[0].item(), summed[1].item(), peak.item()])

    def _site_norm(self, tensors: list[torch.Tensor]) -> float:
        sumsq = sum((t.double().square().sum() for t in tensors), torch.zeros((), dtype=torch.float64))
        total = torch.tensor([float(sumsq)], dtype=torch.float64, device=self.topology.world.device)
        self.topology.site_all_reduce(total)
        return float(total.sqrt())

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"outer": [o.clone() for o in self.outer], "optimizer": self.optimizer.state_dict(), "outer_step": self.outer_step}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for o, saved in zip(self.outer, state["outer"], strict=True):
            o.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.outer_step = state["outer_step"]
