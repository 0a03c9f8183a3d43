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
