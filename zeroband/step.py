"""One inner step of one rank, and the site's evaluation: what the loop (zeroband/train.py) calls."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import cast

import torch
from torch.distributed.tensor import DTensor

from zeroband.mesh import Topology
from zeroband.models.llama import cross_entropy_loss


def forward_backward(model: torch.nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                     device: torch.device) -> torch.Tensor:
    """Accumulate gradients over the micro-batches; returns the mean loss on this rank, on the
    device (reading it would wait for the GPU: `settle_step` reads everything once per step)."""
    total = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        loss = cross_entropy_loss(model(to_device(inputs, device)), to_device(targets, device)) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    return total


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on `device`; to a GPU from pinned memory without blocking the host (the copy is
    ordered before the kernels that read it on the same stream)."""
    if device.type != "cuda" or batch.device.type != "cpu":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> torch.Tensor:
    """Clip (0 = no clipping, norm still reported), step, zero. Returns the gradient norm, on the device."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


@dataclass(frozen=True)
class StepResult:
    """What the loop needs to know of an inner step, on the host."""

    loss: float  # the site's mean loss, the same bits on every rank (a 1-rank site: its own loss)
    grad_norm: float
    finite: bool  # every rank of the site saw a finite loss and gradient norm (they must all agree to stop)


def step_result(values: list[float], ranks: int) -> StepResult:
    """The host numbers `settle_step` read, as a decision: [the loss summed over the site's `ranks`
    ranks, how many of them saw a NaN/inf, the gradient norm]."""
    loss_sum, bad, grad_norm = values
    loss = loss_sum / ranks  # x / 1 is x: a 1-rank site's loss is its own, bit for bit
    return StepResult(loss, grad_norm, finite=bad == 0.0 and math.isfinite(loss) and math.isfinite(grad_norm))


def settle_step(loss: torch.Tensor, grad_norm: torch.Tensor, topology: Topology) -> StepResult:
    """The step's one host sync. A multi-rank site first SUMs [loss, non-finite flag] over its ranks
    in one all-reduce on the device: the site-mean loss (so the log needs no reduction of its own)
    and the count of ranks that must stop. A 1-rank site has nothing to agree on: no collective.
    The gradient norm is already the site's (clip_grad_norm_ over the shards)."""
    norm = grad_norm.detach().reshape(1).double()
    site = torch.cat([loss.detach().reshape(1).double(), torch.zeros_like(norm)])  # [loss, non-finite flag]
    ranks = topology.world.ranks_per_site
    if ranks > 1:
        site[1] = (~torch.isfinite(torch.cat([site[:1], norm]))).any()  # on the device: no wait
        topology.site_all_reduce(site)
    return step_result(torch.cat([site, norm]).tolist(), ranks)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], topology: Topology) -> float:
    """Mean validation loss (nats/token) over the site: every rank evaluates its own share."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=topology.world.device)
    count = torch.zeros((), dtype=torch.float64, device=total.device)
    for inputs, targets in batches:
        loss = cross_entropy_loss(model(to_device(inputs, total.device)), to_device(targets, total.device))
        # summed on the device (no wait per batch), in float64 as the host sums were: the same bits
        total += torch.stack([loss.detach().double() * targets.numel(), count + targets.numel()])
    model.train()
    topology.site_all_reduce(total)
    return (total[0] / total[1]).item()


def validation_metrics(loss: float, bytes_per_token: float) -> dict[str, float]:
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_bpb": loss / math.log(2) / bytes_per_token}


class ComputeTimer:
    """Seconds of device work between marks, without waiting for the device at each mark: CUDA
    events on a GPU (read after the step's one sync), the host clock elsewhere. `mark()` opens or
    closes a span; `seconds()` (after the device caught up) sums the spans and starts over."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[torch.cuda.Event | float] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> float:
        pairs = list(zip(self.marks[::2], self.marks[1::2]))
        self.marks = []
        if self.cuda:
            events = cast(list[tuple[torch.cuda.Event, torch.cuda.Event]], pairs)  # marks are events on CUDA
            return sum(a.elapsed_time(b) for a, b in events) / 1e3
        return sum(b - a for a, b in cast(list[tuple[float, float]], pairs))  # and clock readings elsewhere
