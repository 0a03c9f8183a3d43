"""The membership decisions alone: pure functions, and the store protocol on a real TCPStore."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from tests.multiproc import free_port
from zeroband.comm.reduce import contributing_sites, site_weight
from zeroband.membership.heartbeat import Liveness
from zeroband.membership.rounds import (
    RoundCoordinator,
    RoundTimeout,
    WaitState,
    decide_members,
    decide_verdict,
    orphaned,
)
from zeroband.store.client import open_store


def test_members_wait_for_every_expected_live_site():
    wait = WaitState()
    assert decide_members({0, 1}, {0, 1, 2}, {0, 1, 2}, 1, 5.0, now=0.0, wait=wait) is None
    assert decide_members({0, 1, 2}, {0, 1, 2}, {0, 1, 2}, 1, 5.0, now=1.0, wait=wait) == [0, 1, 2]


def test_dead_site_is_not_waited_for_and_grace_cuts_stragglers():
    assert decide_members({0, 1}, {0, 1}, {0, 1, 2}, 1, 5.0, now=0.0, wait=WaitState()) == [0, 1]
    wait = WaitState()
    assert decide_members({0}, {0, 1}, {0, 1}, 1, 5.0, now=0.0, wait=wait) is None
    assert decide_members({0}, {0, 1}, {0, 1}, 1, 5.0, now=5.0, wait=wait) == [0]  # 1 is late: left out


def test_quorum_and_launch_wait_for_unseen_sites():
    assert decide_members({0}, {0}, {0, 1}, 2, 0.0, now=0.0, wait=WaitState()) is None  # below min_sites
    wait = WaitState()
    assert decide_members({0}, {0}, {0, 1}, 1, 3.0, now=0.0, wait=wait, wait_for_unseen=True) is None
    assert decide_members({0}, {0}, {0, 1}, 1, 3.0, now=3.0, wait=wait, wait_for_unseen=True) == [0]


def test_orphaned_only_when_every_live_site_arrived_fresh():
    assert orphaned({0: "fresh", 1: "fresh"}, alive={0, 1}, me=1)  # every holder died: re-form
    assert not orphaned({0: "fresh", 1: "ready"}, alive={0, 1}, me=0)  # a holder proposes
    assert not orphaned({1: "fresh"}, alive={0, 1}, me=1)  # 0 is alive, not arrived: it may hold the state
    assert orphaned({1: "fresh", 2: "fresh"}, alive={1, 2}, me=2)  # a dead site's old arrival is not needed
    assert not orphaned({1: "fresh"}, alive={1}, me=1) and not orphaned({}, alive=set(), me=0)  # alone: nothing to join


def test_verdict():
    assert decide_verdict([0, 1], {0: "ok"}, gone=set()) is None
    assert decide_verdict([0, 1], {0: "ok", 1: "ok"}, gone=set()) == "commit"
    assert decide_verdict([0, 1], {0: "ok", 1: "fail"}, gone=set()) == "abort"
    assert decide_verdict([0, 1], {0: "ok"}, gone={1}) == "abort"


def test_contributors_nan_outlier_abstain_and_token_weights():
    import torch

    # columns: sumsq, nonfinite, abstain, tokens
    table = torch.tensor([[1.0, 0, 0, 100], [1.2, 0, 0, 300], [400.0, 0, 0, 100],
                          [float("nan"), 3, 0, 100], [0.0, 0, 1, 0]], dtype=torch.float64)
    use = contributing_sites(table, outlier_factor=10.0)
    assert use == [True, True, False, False, False]  # outlier (norm 20 vs ~1), NaN, abstainer
    assert site_weight(table, use, 1, by_tokens=True) == pytest.approx(0.75)
    assert site_weight(table, use, 0, by_tokens=False) == 0.5 and site_weight(table, use, 2, by_tokens=True) == 0.0


def test_joiner_with_nobody_to_join_gives_up():
    address = f"tcp://127.0.0.1:{free_port()}"
    store = open_store(address, True, timedelta(seconds=10))
    store.add("p/committed", 5)  # a run that got somewhere, whose sites are all gone
    liveness = Liveness(store, "p/", range(3), dead_after_s=0.5)
    rounds = RoundCoordinator(store, "p/", 2, True, liveness)
    t0 = time.monotonic()
    with pytest.raises(RoundTimeout, match="nothing to join"):
        rounds.rendezvous(5, 0, set(), 1, 1.0, fresh=True, timeout_s=30, new_generation=lambda m: 1)
    assert time.monotonic() - t0 < 5


def test_one_proposer_per_attempt():
    from zeroband.membership.rounds import proposer

    assert proposer({0: "ready", 1: "ready"}, alive={0, 1}, r=3) == 0
    assert proposer({0: "fresh", 1: "ready"}, alive={0, 1}, r=3) == 1  # a joiner never proposes
    assert proposer({0: "ready", 1: "ready"}, alive={1}, r=3) == 1  # site 0 is dead: the next one takes over
    assert proposer({0: "fresh", 1: "fresh"}, alive={0, 1}, r=0) == 0  # at launch anyone may
    assert proposer({1: "fresh"}, alive={0, 1}, r=2) is None
