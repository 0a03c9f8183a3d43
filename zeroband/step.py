"""One inner step of one rank, and the site's evaluation: what the loop (zeroband/train.py) calls."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zeroband.mesh import Topology
from zeroband.models.llama import cross_entropy_loss


def forward_backward(model: torch.nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                     device: torch.device) -> float:
    """Accumulate gradients over the micro-batches; returns the mean loss on this rank."""
    total = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        loss = cross_entropy_loss(model(inputs.to(device)), targets.to(device)) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    return total.item()


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip (0 = no clipping, norm still reported), step, zero. Returns the gradient norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], topology: Topology) -> float:
    """Mean validation loss (nats/token) over the site: every rank evaluates its own share."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=topology.world.device)
    for inputs, targets in batches:
        loss = cross_entropy_loss(model(inputs.to(topology.world.device)), targets.to(topology.world.device))
        total += torch.tensor([loss.item() * targets.numel(), targets.numel()], dtype=torch.float64, device=total.device)
    model.train()
    topology.site_all_reduce(total)
    return (total[0] / total[1]).item()


def validation_metrics(loss: float, bytes_per_token: float) -> dict[str, float]:
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_bpb": loss / math.log(2) / bytes_per_token}


def finite_on_site(loss: float, grad_norm: float, topology: Topology) -> bool:
    """Every rank of the site saw a finite loss and gradient norm (they must all agree to stop)."""
    bad = torch.tensor([0.0 if math.isfinite(loss) and math.isfinite(grad_norm) else 1.0], device=topology.world.device)
    topology.site_all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


def site_mean(value: float, topology: Topology) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=topology.world.device)
    topology.site_all_reduce(t)
    return t.item() / topology.world.ranks_per_site


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
