"""The inner step's host side (issue 15): one wait for the device per step, decided by pure functions."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from tests.multiproc import run_ranks
from zeroband.config import OptimConfig
from zeroband.optim import adamw_kernel, build_optimizer
from zeroband.step import ComputeTimer, StepResult, step_result


def test_step_result_decides_on_the_site_wide_flag_and_its_own_numbers():
    assert step_result([2.5, 0.75, 0.0]) == StepResult(2.5, 0.75, finite=True)
    assert not step_result([2.5, 0.75, 1.0]).finite  # another rank of the site saw a NaN/inf
    assert not step_result([math.nan, 0.75, 1.0]).finite
    assert not step_result([2.5, math.inf, 0.0]).finite  # never trusts the flag over its own numbers


def _settle(bad_rank: int) -> tuple[float, float, bool]:
    import torch.distributed as dist

    from zeroband.mesh import init_topology, shutdown
    from zeroband.step import settle_step
    from zeroband.world import World

    rank = int(os.environ["RANK"])
    topology = init_topology(World(rank, 2, rank, 0, 1, torch.device("cpu")), None, "settle", 30, "gloo")
    try:
        loss = torch.tensor(math.nan if rank == bad_rank else 1.5 + rank)
        result = settle_step(loss, torch.tensor(0.25 * (rank + 1)), topology)
        dist.barrier()
        return result.loss, result.grad_norm, result.finite
    finally:
        shutdown()


@pytest.mark.parametrize("bad_rank", [-1, 1])
def test_settle_step_agrees_on_finiteness_over_the_site(bad_rank: int):
    """Two real ranks: each keeps its own loss and norm; one rank's NaN stops both."""
    out = run_ranks(_settle, 2, (bad_rank,), timeout=60)
    finite = bad_rank < 0
    assert [o[2] for o in out] == [finite, finite]
    assert out[0][:2] == (1.5, 0.25)
    assert out[1][1] == 0.5 and (out[1][0] == 2.5 if finite else math.isnan(out[1][0]))


def test_compute_timer_sums_its_spans_and_starts_over():
    timer = ComputeTimer(torch.device("cpu"))
    timer.mark()
    time.sleep(0.05)
    timer.mark()
    time.sleep(0.2)  # between spans: not compute (the cross-site gradient sync's place)
    timer.mark()
    time.sleep(0.05)
    timer.mark()
    seconds = timer.seconds()
    assert 0.1 <= seconds < 0.25  # both 50 ms spans, not the 200 ms gap
    assert timer.seconds() == 0.0


def test_adamw_kernel_is_the_single_tensor_loop_off_the_gpu():
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    assert adamw_kernel(params) == {"foreach": False, "fused": False}
    opt = build_optimizer(params, OptimConfig())
    assert all(g["foreach"] is False and g["fused"] is False for g in opt.param_groups)
