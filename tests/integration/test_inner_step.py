"""The inner step's host side (issue 15): one wait for the device per step, decided by pure functions."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.multiproc import run_ranks
from zeroband.step import settle_step
from zeroband.world import World


def _settle(bad: str) -> tuple[float, float, bool]:
    """Rank r has loss 1.5 + r and grad norm 0.25 (r + 1); `bad` ("loss"/"norm") makes rank 1's non-finite."""
    import torch.distributed as dist

    from zeroband.mesh import init_topology, shutdown

    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    topology = init_topology(World(rank, ranks, rank, 0, 1, torch.device("cpu")), None, "settle", 30, "gloo")
    try:
        loss = torch.tensor(math.nan if (rank, bad) == (1, "loss") else 1.5 + rank)
        norm = torch.tensor(math.inf if (rank, bad) == (1, "norm") else 0.25 * (rank + 1))
        result = settle_step(loss, norm, topology)
        dist.barrier()
        return result.loss, result.grad_norm, result.finite
    finally:
        shutdown()


@pytest.mark.parametrize("bad", ["", "loss", "norm"])
def test_settle_step_gives_the_site_mean_loss_and_agrees_on_finiteness(bad: str):
    """Three real ranks, one all-reduce: every rank gets the same site-mean loss and keeps its own
    norm; a NaN loss or an inf norm on one rank stops all of them."""
    out = run_ranks(_settle, 3, (bad,), timeout=60)
    assert [o[2] for o in out] == [not bad] * 3
    assert [o[1] for o in out] == [0.25, 0.5 if bad != "norm" else math.inf, 0.75]
    losses = [o[0] for o in out]
    assert all(math.isnan(x) for x in losses) if bad == "loss" else losses == [2.5] * 3


def _stop_agreed(requester: int) -> bool:
    from zeroband.mesh import init_topology, shutdown
    from zeroband.train import GracefulStop

    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    topology = init_topology(World(rank, ranks, rank, 0, 1, torch.device("cpu")), None, "stop", 30, "gloo")
    try:
        stop = GracefulStop()
        stop.requested = rank == requester
        return stop.agreed(topology)
    finally:
        shutdown()


@pytest.mark.parametrize("requester", [-1, 1])
def test_graceful_stop_on_a_two_rank_site_stops_both_ranks(requester: int):
    """SIGTERM on one rank of a multi-rank site stops all of its ranks after the same step."""
    assert run_ranks(_stop_agreed, 2, (requester,), timeout=60) == [requester >= 0] * 2
