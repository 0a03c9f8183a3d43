"""Where DiLoCo's fp32 outer copy lives and how values move between it and the local shard.

On the host by default (pinned when the model is on a GPU, so copies are non-blocking), or on the
GPU (`diloco.outer_device`); the pseudo-gradient goes into one host vector that a blocking step
reuses, so the all-reduce averages it in place. The arithmetic is the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zeroband.comm.direct import flat_base
from zeroband.comm.kernels import ChunkStats, Measured, count_nonfinite, kernels, set_threads, streams
from zeroband.comm.timing import Parts
from zeroband.config import DilocoConfig
from zeroband.outer import sgd_kernel
from zeroband.outer.stats import chunks_of


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of `flat` shaped like the tensors of `like` (they tile it exactly)."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


def _subtract(outer: torch.Tensor, local: torch.Tensor, out: torch.Tensor, acc: ChunkStats) -> None:
    """out <- outer - local, chunk by chunk, each measured by `acc` while it is still in cache."""
    o, t, g = outer.reshape(-1), local.reshape(-1), out.view(-1)
    for s in chunks_of(g):
        torch.sub(o[s], t[s], out=g[s])
        acc.add(g[s])


def pick_outer_device(setting: str, local: torch.device, blocking: bool, need_bytes: int,
                      free_bytes: int | None) -> torch.device:
    """Where the outer copy and momentum live: the CPU for a CPU model; on a GPU, "auto" keeps them
    there when the step is blocking and `need_bytes` fits in half the GPU's free memory."""
    if local.type != "cuda" or setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda" or (blocking and free_bytes is not None and need_bytes <= free_bytes // 2):
        return local
    return torch.device("cpu")


def outer_thread_count(setting: int, affinity_cores: int, local_ranks: int) -> int:
    """Threads of the outer step: the setting, or the cores this rank owns (at least 1)."""
    return setting or max(1, affinity_cores // max(1, local_ranks))


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads and the native kernels' (comm/kernels.py, outer/sgd_kernel.py) set to
    `n` for the block (the inner step keeps its own setting)."""
    before, kernel_before, sgd_before = torch.get_num_threads(), set_threads(n), sgd_kernel.set_threads(n)
    change = n != before  # nothing to change: leave the process-wide setting alone
    if change:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if change:
            torch.set_num_threads(before)
        set_threads(kernel_before)
        sgd_kernel.set_threads(sgd_before)


class OuterCopy:
    """The fp32 outer copy (`tensors`) of the local shard, and the pseudo-gradient's buffers."""

    def __init__(self, local: list[torch.Tensor], cfg: DilocoConfig) -> None:
        self.local = local
        device = local[0].device if local else torch.device("cpu")
        numel = sum(t.numel() for t in local)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        blocking = not (cfg.overlap or cfg.elastic)
        self.device = pick_outer_device(cfg.outer_device, device, blocking, 3 * 4 * numel, free)
        pinned = device.type == "cuda"
        self.tensors = [t.detach().to(self.device, torch.float32, copy=True) for t in local]
        if pinned and self.device.type == "cpu":
            self.tensors = [o.pin_memory() for o in self.tensors]
        self.host_grads = torch.empty(numel, dtype=torch.float32, pin_memory=pinned)
        self.stream = streams(4 * numel)  # host passes over it write past the cache (comm/kernels.py)
        self.in_flight_grads: torch.Tensor | None = None  # the other vector of an overlapped step's pair
        on_gpu = self.device.type == "cuda"
        self.device_grads = torch.empty(numel, dtype=torch.float32, device=device) if on_gpu else None
        self.measured: tuple[list[torch.Tensor] | None, int, Measured] = (None, 0, (0.0, 0.0))

    def pseudo_gradient(self, parts: Parts, fresh: bool) -> list[torch.Tensor]:
        """Outer copy - local shard in fp32 on the host, as views of one vector. `fresh`: not the vector
        returned last time, which an overlapped step may still have in flight; two vectors take turns
        (one in flight at a time; a new vector per step was a page fault per 4 KB). The same pass
        measures its statistics chunk by chunk while each is in cache (`stats_of`)."""
        host = self.host_grads
        if fresh:
            if self.in_flight_grads is None:
                self.in_flight_grads = torch.empty(self.host_grads.numel(), dtype=torch.float32,
                                                   pin_memory=self.host_grads.is_pinned())
            host, self.host_grads, self.in_flight_grads = self.in_flight_grads, self.in_flight_grads, self.host_grads
        grads = _views(host, self.local)
        if self.device_grads is not None:  # outer copy on the GPU: subtract and measure there, ship the result
            acc = ChunkStats()
            with parts("pseudo_grad"):
                for g, o, t in zip(_views(self.device_grads, self.local), self.tensors, self.local):
                    _subtract(o, t.detach(), g, acc)
                measured = acc.result(grads)
            with parts("d2h"):
                host.copy_(self.device_grads, non_blocking=True)
                torch.cuda.synchronize(self.device_grads.device)
        else:
            on_gpu = any(t.is_cuda for t in self.local)
            if on_gpu:  # outer copy on the host: bring the model over first, into the result's memory
                with parts("d2h"):
                    for g, t in zip(grads, self.local):
                        g.copy_(t.detach(), non_blocking=True)
                    torch.cuda.synchronize(self.local[0].device)
            with parts("pseudo_grad"):  # one pass: subtract and measure (comm/kernels.py)
                k = kernels()
                sumsq = sum(k.sub_sumsq(o.view(-1), (g if on_gpu else t.detach()).reshape(-1), g.view(-1), self.stream)
                            for g, o, t in zip(grads, self.tensors, self.local))
                measured = (sumsq, count_nonfinite(grads, sumsq))
        with parts("pseudo_grad"):
            self.measured = (grads, grads[0]._version if grads else 0, measured)
        return grads

    def stats_of(self, grads: list[torch.Tensor]) -> Measured | None:
        """The statistics the last `pseudo_gradient` pass measured, if `grads` are its result, unchanged
        since (views of one vector share its version counter: any write to any of them shows); else None."""
        kept, version, triple = self.measured
        if grads is kept and (not grads or grads[0]._version == version):
            return triple
        return None

    def to_local(self) -> None:
        """local <- outer (non-blocking from pinned memory or on the GPU; done before returning)."""
        if any(t.is_cuda for t in self.local):
            for t, o in zip(self.local, self.tensors):
                t.copy_(o, non_blocking=True)
            torch.cuda.synchronize(self.local[0].device)  # the outer copy must not change under a copy in flight
            return
        k = kernels()
        for t, o in zip(self.local, self.tensors):  # past the cache when the model is larger than it
            if t.is_contiguous():
                k.copy(o.view(-1), t.view(-1), self.stream)
            else:
                t.copy_(o)

    def on_outer_device(self, grads: list[torch.Tensor], parts: Parts) -> list[torch.Tensor]:
        """The average where the outer copy is: sent back to the GPU when the copy lives there."""
        if self.device_grads is None:
            return grads
        with parts("h2d"):
            base = flat_base(grads)
            self.device_grads.copy_(base if base is not None else torch.cat([g.reshape(-1) for g in grads]),
                                    non_blocking=True)
        return _views(self.device_grads, self.tensors)
