"""The grace window of `diloco.grace_s = "auto"` (zeroband/membership/grace.py): the rule alone, the
lateness it reads, and the meter that feeds it."""

from __future__ import annotations

import pytest

from zeroband.config import ConfigError, DilocoConfig, validate_config
from zeroband.membership.elastic import grace_steps
from zeroband.membership.grace import GraceMeter, GraceRule, Measured, auto_grace, lateness
from zeroband.membership.rounds import WaitState, decide_members

RULE = GraceRule(slack_margin=0.5, late_margin=2.0, floor_s=1.0, cap_s=60.0)


def test_overlapped_with_slack_waits_the_margin_of_the_slack():
    # the exchange runs 100 steps of 1 s behind; quorum 10 s + exchange 30 s leave 60 s of slack
    m = Measured(step_s=1.0, sync_s=30.0, quorum_s=10.0, late_s=0.2, steps_per_round=500, overlap_steps=100)
    assert auto_grace(m, sites=4, fallback_s=5.0, rule=RULE) == pytest.approx(30.0)
    # the slack is free: a lateness above it but under the round's worth still wins
    assert auto_grace(Measured(1.0, 30.0, 10.0, 20.0, 500, 100), 4, 5.0, RULE) == pytest.approx(40.0)


def test_overlapped_with_no_slack_left_falls_back_to_the_lateness():
    # quorum 20 s + exchange 90 s > 100 steps of 1 s: waiting costs compute, as when blocking
    m = Measured(step_s=1.0, sync_s=90.0, quorum_s=20.0, late_s=1.5, steps_per_round=500, overlap_steps=100)
    assert auto_grace(m, 4, 5.0, RULE) == pytest.approx(3.0)
    assert auto_grace(Measured(1.0, 90.0, 20.0, 0.1, 500, 100), 4, 5.0, RULE) == 1.0  # the floor


def test_blocking_follows_the_worst_recent_lateness():
    m = Measured(step_s=0.5, sync_s=4.0, quorum_s=0.0, late_s=2.5, steps_per_round=500, overlap_steps=0)
    assert auto_grace(m, 3, 5.0, RULE) == pytest.approx(5.0)
    # no slack without overlap, however long the round: sites that arrived together wait the floor
    assert auto_grace(Measured(10.0, 1.0, 0.0, 0.0, 500, 0), 3, 5.0, RULE) == 1.0


def test_blocking_never_waits_more_than_the_late_sites_round_is_worth():
    # 2 s rounds, 3 sites: two sites waiting 1 s each cost a whole round of the late one's
    m = Measured(step_s=0.01, sync_s=0.1, quorum_s=0.0, late_s=3.0, steps_per_round=200, overlap_steps=0)
    assert auto_grace(m, 3, 5.0, GraceRule(floor_s=0.1)) == pytest.approx(1.0)
    assert auto_grace(m, 2, 5.0, GraceRule(floor_s=0.1)) == pytest.approx(2.0)


def test_nothing_measured_yet_uses_the_configured_value():
    assert auto_grace(Measured(), 3, 5.0, RULE) == 5.0
    assert auto_grace(Measured(step_s=1.0, steps_per_round=10), 3, 7.5, RULE) == 7.5  # no lateness yet
    # overlapped, the exchange not timed yet: no slack known either
    assert auto_grace(Measured(step_s=1.0, quorum_s=0.0, steps_per_round=10, overlap_steps=5), 3, 5.0, RULE) == 5.0


def test_clamped_to_the_floor_and_the_cap():
    assert auto_grace(Measured(1.0, 0.0, 0.0, 0.01, 500, 0), 2, 5.0, RULE) == 1.0
    assert auto_grace(Measured(10.0, 0.0, 0.0, 100.0, 500, 0), 2, 5.0, RULE) == 60.0
    assert auto_grace(Measured(10.0, 1.0, 1.0, 0.0, 500, 400), 2, 5.0, RULE) == 60.0  # slack 3998 s


def test_lateness_counts_a_site_missing_at_the_decision_as_late_by_the_whole_wait():
    assert lateness({0: 10.0, 1: 10.2, 2: 11.5}, 10.0, {0, 1, 2}, 12.0) == pytest.approx(1.5)
    assert lateness({0: 10.0, 1: 9.0}, 10.0, {0, 1}, 10.0) == 0.0  # all in before the quorum
    assert lateness({0: 10.0}, 10.0, {0, 1}, 11.0) == pytest.approx(1.0)  # left out at 1 s: at least 1 s
    assert lateness({0: 10.0}, None, {0, 1}, 11.0) is None


def test_a_wait_state_reports_the_quorum_time_and_the_lateness():
    wait = WaitState(started=100.0, seen_at={0: 100.0, 1: 100.5})
    assert decide_members({0}, {0, 1}, {0, 1}, 1, 5.0, now=100.2, wait=wait) is None  # the quorum: site 0
    assert wait.timings() == (None, None)  # not decided yet
    wait.decided_at, wait.waited_for = 100.5, {0, 1}
    assert wait.timings() == pytest.approx((0.2, 0.3))


def test_the_meter_times_steps_exchanges_and_keeps_the_worst_recent_lateness():
    meter = GraceMeter(steps_per_round=10, overlap_steps=0)
    meter.arrived(0.0)  # round 0: nothing trained before it
    meter.decided(1.0, None, None)
    meter.committed(3.0)
    assert meter.measured() == Measured(None, 2.0, None, None, 10, 0)
    meter.arrived(13.0)  # 10 steps in 10 s
    meter.decided(13.5, 0.1, 0.4)
    meter.committed(14.5)
    meter.arrived(24.5)
    meter.decided(24.6, 0.1, 0.1)
    got = meter.measured()
    assert got.step_s == pytest.approx(1.0) and got.late_s == pytest.approx(0.4) and got.quorum_s == pytest.approx(0.1)
    assert got.sync_s == pytest.approx(0.7 * 2.0 + 0.3 * 1.0)  # EWMA
    meter.restart(None)  # left out: it waits for the next boundary, nothing to time
    meter.arrived(100.0)
    assert meter.measured().step_s == pytest.approx(1.0)


def test_grace_steps_per_round_and_overlap():
    assert grace_steps(DilocoConfig(inner_steps=8)) == (8, 0)
    assert grace_steps(DilocoConfig(inner_steps=8, fragments=2)) == (4, 0)
    assert grace_steps(DilocoConfig(inner_steps=8, overlap=True)) == (8, 8)
    assert grace_steps(DilocoConfig(inner_steps=8, overlap=True, overlap_steps=3)) == (8, 3)


def test_grace_s_takes_auto_or_seconds_and_names_the_fix_otherwise():
    assert DilocoConfig().grace_s == "auto"
    assert DilocoConfig(grace_s=5).grace_s == 5.0 and DilocoConfig(grace_s="2.5").grace_s == 2.5
    for bad in ("soon", -1, True, "nan"):
        with pytest.raises(ConfigError) as e:
            validate_config({"diloco": {"inner_steps": 2, "grace_s": bad}})
        assert 'diloco.grace_s: Value error, use "auto"' in str(e.value) and "Fix: --diloco.grace_s auto" in str(e.value)
        assert len(str(e.value).splitlines()) == 2  # the header and one line
