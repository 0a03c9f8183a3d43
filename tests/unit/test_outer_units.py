"""Pure parts of the outer loop and of membership: no processes, no sockets."""

import pytest

from zeroband.config import DilocoConfig
from zeroband.membership.base import EventLog
from zeroband.outer.base import RoundClock
from zeroband.outer.optimizer import outer_hyperparameters


def test_outer_hyperparameters_schedule_and_warmup():
    cfg = DilocoConfig(outer_lr=0.7, outer_momentum=0.5, outer_momentum_warmup=5, outer_lr_schedule="inner")
    assert outer_hyperparameters(cfg, 0, 0.5) == (pytest.approx(0.35), pytest.approx(0.1))
    assert outer_hyperparameters(cfg, 4, 1.0) == (pytest.approx(0.7), pytest.approx(0.5))
    assert outer_hyperparameters(cfg, 40, 1.0)[1] == pytest.approx(0.5)  # ramp capped at outer_momentum
    flat = DilocoConfig(outer_lr=0.7, outer_momentum=0.9, outer_momentum_warmup=0)
    assert outer_hyperparameters(flat, 0, 0.25) == (0.7, 0.9)  # constant schedule ignores the inner factor


def test_event_log_keeps_events_until_attached():
    events = EventLog(site=2)
    events.emit("decision", round=0, attempt=0, members=[0, 2], fresh=[2], generation=1)
    got: list[dict] = []
    events.attach(got.append)
    events.emit("commit", round=0, attempt=0, members=[0, 2], generation=1, joined=[2])
    assert [e["event"] for e in got] == ["decision", "commit"]
    assert got[0] == {"event": "decision", "site": 2, "round": 0, "attempt": 0, "members": [0, 2], "fresh": [2],
                      "generation": 1}


def test_round_clock_one_rule_for_the_end():
    steps = RoundClock(DilocoConfig(inner_steps=4), 0)
    assert not steps.finished(7, 8) and steps.finished(8, 8)
    budget = RoundClock(DilocoConfig(inner_steps=4, round_seconds=1.0), 0)
    assert not budget.finished(100, 8)  # a time budget counts rounds, not steps
    assert budget.finished(3, 8, rounds_done=2)  # the membership's shared count (elastic) decides


def test_estimate_weight_per_overlap_rule() -> None:
    from zeroband.outer.overlap import estimate_weight

    assert estimate_weight("eager", 4) == 1.0
    assert estimate_weight("eager_share", 4) == 0.25
    assert estimate_weight("delayed", 4) is None


def test_run_step_follows_rounds_under_a_time_budget():
    """Rounds of inner_steps steps: the run step is the site's own. A time budget: the run's rounds x
    inner_steps plus this round's steps (below the next multiple), so sites of any speed meet at
    boundaries, and only there on a multiple of inner_steps (where checkpoints fall)."""
    steps = RoundClock(DilocoConfig(inner_steps=4), 0)
    assert [steps.run_step(s) for s in (0, 3, 9)] == [0, 3, 9]
    budget = RoundClock(DilocoConfig(inner_steps=4, round_seconds=1.0), 0)
    budget.rounds, budget.steps_in_round = 2, 1
    assert budget.run_step(3) == 9  # a slow site: 3 steps of its own, 2 rounds of the run behind it
    budget.steps_in_round = 7
    assert budget.run_step(30) == 11  # a fast one holds below the next boundary until it is there
    assert budget.run_step(30, rounds_done=5) == 23  # the membership's shared count (elastic) decides


def test_follow_schedule_moves_only_a_schedule_that_is_elsewhere():
    import torch

    from zeroband.config import OptimConfig
    from zeroband.optim import build_scheduler, follow_schedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine"), 20)
    opt.step()
    sched.step()
    follow_schedule(sched, 1)  # already there: untouched
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.5
    follow_schedule(sched, 3)
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == 1.0 and sched.get_last_lr() == [1.0]


def test_step_clock_ends_a_round_after_the_steps_that_fit():
    from zeroband.sim import StepClock

    cfg = DilocoConfig(inner_steps=4, round_seconds=4.0)
    fast, slow = StepClock(RoundClock(cfg, 8), 1.0), StepClock(RoundClock(cfg, 8), 2.0)
    assert [fast.tick(s) for s in range(1, 5)] == [False, False, False, True]
    assert [slow.tick(s) for s in range(1, 3)] == [False, True]
    assert slow.take_tokens() == 16.0 and fast.take_tokens() == 32.0  # weighed by the tokens each did
    with pytest.raises(ValueError, match="round_seconds"):
        StepClock(RoundClock(DilocoConfig(inner_steps=4), 8), 1.0)


def test_a_late_site_offers_its_round_once_one_round_stale_and_only_with_a_weight() -> None:
    """`DiLoCo.offer`, the late-work rule: a member brings its round (weight 1); a site left out of
    its round (it holds `grads` but no longer contributes) brings them to the next round only, with
    diloco.late_weight; older work, a weight of 0, or a joiner with nothing brings nothing."""
    from types import SimpleNamespace

    import torch

    from zeroband.outer.diloco import DiLoCo

    grads = [torch.ones(3)]
    member, left_out = SimpleNamespace(contributes=True), SimpleNamespace(contributes=False)

    def offer(weight: float, attempt: SimpleNamespace, age: int, g: list | None = grads) -> tuple:
        return DiLoCo.offer(SimpleNamespace(cfg=SimpleNamespace(late_weight=weight)), g, attempt, age)  # type: ignore[arg-type]

    assert offer(0.5, member, 0) == (grads, 1.0)
    assert offer(0.5, left_out, 1) == (grads, 0.5)
    assert offer(0.5, left_out, 2) == (None, 1.0) and offer(0.0, left_out, 1) == (None, 1.0)
    assert offer(0.5, left_out, 1, None) == (None, 1.0)
