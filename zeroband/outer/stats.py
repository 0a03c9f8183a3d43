"""Statistics of a pseudo-gradient: what the sites compare before averaging (comm/reduce.py)."""

from __future__ import annotations

import torch

from zeroband.comm.direct import flat_base
from zeroband.comm.kernels import STATS_CHUNK, ChunkStats, Measured
from zeroband.comm.reduce import SiteStats
from zeroband.mesh import Topology


def chunks_of(flat: torch.Tensor, size: int = STATS_CHUNK) -> list[slice]:
    return [slice(i, i + size) for i in range(0, flat.numel(), size)]


def tensor_stats(tensors: list[torch.Tensor]) -> Measured:
    """(sum of squares, NaN/inf count) of fp32 tensors in one read pass, without temporaries."""
    base = flat_base(tensors)
    flats = [base] if base is not None else [t.detach().reshape(-1) for t in tensors if t.numel()]
    acc = ChunkStats()
    for f in flats:
        for s in chunks_of(f):
            acc.add(f[s])
    return acc.result(tensors)


def site_stats(tensors: list[torch.Tensor], topology: Topology, tokens: float = 0.0,
               local: Measured | None = None) -> SiteStats:
    """Sum of squares and non-finite count over the whole site (a site-group reduction);
    `local`: this rank's statistics of `tensors` when a pass already measured them."""
    summed = torch.tensor(local if local is not None else tensor_stats(tensors), dtype=torch.float64,
                          device=topology.world.device)
    topology.site_all_reduce(summed)
    sumsq, nonfinite = summed.tolist()
    return SiteStats(sumsq, nonfinite, tokens=tokens)
