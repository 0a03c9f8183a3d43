"""The inner step's host side (issue 15): one wait for the device per step, decided by pure functions."""

from __future__ import annotations

import math
import time

import pytest
import torch

from zeroband.config import OptimConfig
from zeroband.mesh import Topology
from zeroband.optim import adamw_kernel, build_optimizer
from zeroband.step import ComputeTimer, StepResult, settle_step, step_result
from zeroband.world import World


def test_step_result_takes_the_site_mean_and_stops_on_any_bad_rank():
    assert step_result([2.5, 0.0, 0.75], 1) == StepResult(2.5, 0.75, finite=True)
    assert step_result([5.0, 0.0, 0.75], 2) == StepResult(2.5, 0.75, finite=True)  # the site's mean
    assert not step_result([5.0, 1.0, 0.75], 2).finite  # another rank of the site saw a NaN/inf
    assert not step_result([math.nan, 1.0, 0.75], 2).finite
    assert not step_result([2.5, 0.0, math.inf], 1).finite  # never trusts the count over its own numbers


def _one_rank_site(monkeypatch: pytest.MonkeyPatch) -> Topology:
    """A 1-rank site's topology, on which any collective fails the test."""
    import torch.distributed as dist

    def no_collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("a 1-rank site reduced something")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    return Topology(World(0, 1, 0, 0, 1, torch.device("cpu")), site_mesh=None)


def test_settle_step_on_a_one_rank_site_is_its_own_loss_with_no_collective(monkeypatch):
    topology = _one_rank_site(monkeypatch)
    loss = torch.tensor(2.0 / 3.0)  # float32, as forward_backward returns it
    assert settle_step(loss, torch.tensor(0.5), topology) == StepResult(float(loss), 0.5, finite=True)
    assert not settle_step(torch.tensor(math.nan), torch.tensor(0.5), topology).finite


@pytest.mark.parametrize("requested", [False, True])
def test_graceful_stop_on_a_one_rank_site_reads_its_own_flag(monkeypatch, requested: bool):
    from zeroband.train import GracefulStop

    topology = _one_rank_site(monkeypatch)

    def no_tensor(*args: object, **kwargs: object) -> None:
        raise AssertionError("a 1-rank site built a tensor for its stop flag")

    monkeypatch.setattr(torch, "tensor", no_tensor)  # no tensor: nothing to wait for either
    stop = GracefulStop()
    stop.requested = requested
    assert stop.agreed(topology) is requested


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
