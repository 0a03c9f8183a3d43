"""The membership decisions alone: pure functions, and the store protocol on a real TCPStore."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from tests.multiproc import free_port
from zeroband.comm.reduce import contributing_sites, site_weight
from zeroband.membership.heartbeat import Heartbeat, Liveness
from zeroband.membership.rounds import (
    Decision,
    RoundCoordinator,
    RoundTimeout,
    RunComplete,
    WaitState,
    decide_members,
    decide_verdict,
    orphaned,
    overdue,
    run_over,
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


def test_a_missing_vote_is_overdue_only_past_the_link_bound():
    assert overdue([0, 1], {0: "ok"}, since_vote_s=0.9, bound_s=1.0) == set()
    assert overdue([0, 1], {0: "ok"}, since_vote_s=1.0, bound_s=1.0) == {1}
    assert overdue([0, 1, 2], {0: "ok", 2: "ok"}, 5.0, 1.0) == {1} and overdue([0, 1], {0: "ok", 1: "ok"}, 5.0, 1.0) == set()
    assert overdue([0, 1], {0: "ok"}, 1e6, None) == set()  # no measured link: only dead_after_s and timeout_s
    assert decide_verdict([0, 1], {0: "ok"}, gone=overdue([0, 1], {0: "ok"}, 2.0, 1.0)) == "abort"


def _voting_pair(address: str) -> tuple[list[Heartbeat], list[RoundCoordinator], Decision]:
    """Sites 0 and 1 of a round on a real TCPStore, both beating (alive for dead_after_s = 60 s)."""
    beats = [Heartbeat(lambda: open_store(address, False, timedelta(seconds=10)), "p/", s, 0.1).start() for s in (0, 1)]
    coords = []
    for s in (0, 1):
        store = open_store(address, False, timedelta(seconds=10))
        coords.append(RoundCoordinator(store, "p/", s, True, Liveness(store, "p/", range(2), dead_after_s=60.0)))
    time.sleep(0.3)  # the first beats are in
    return beats, coords, Decision([0, 1], [], 1)


def test_a_live_member_that_never_votes_is_aborted_at_the_link_bound_not_the_timeout():
    """Site 1 beats (alive) but froze after its last message of the exchange: its vote never comes.
    Site 0 voted ok; it aborts at the bound (0.5 s), not at timeout_s (30 s); a vote 0.2 s late commits."""
    address = f"tcp://127.0.0.1:{free_port()}"
    server = open_store(address, True, timedelta(seconds=10))
    beats, (site0, site1), decision = _voting_pair(address)
    try:
        t0 = time.monotonic()
        assert site0.vote_and_verdict(1, 0, decision, True, timeout_s=30.0, bound_s=0.5) == "abort"
        assert time.monotonic() - t0 < 3.0
        late = threading.Timer(0.2, site1.vote_and_verdict, (1, 1, decision, True, 30.0, 2.0))
        late.start()
        assert site0.vote_and_verdict(1, 1, decision, True, timeout_s=30.0, bound_s=2.0) == "commit"
        late.join()
    finally:
        for beat in beats:
            beat.stop()
    del server


def _table(*rows: list[float], weights: list[float] | None = None):
    """A stats table (comm/reduce.py STAT_COLUMNS) from rows of sumsq, nonfinite, abstain, tokens."""
    import torch

    from zeroband.comm.reduce import SiteStats

    weights = weights or [1.0] * len(rows)
    return torch.tensor([SiteStats(a, b, bool(c), d, weight=w).as_list() for (a, b, c, d), w in zip(rows, weights)],
                        dtype=torch.float64)


def test_a_late_sites_weight_scales_its_share_and_a_weight_out_of_range_is_excluded():
    """diloco.late_weight: a late site declares its weight; its share (of 1/n or of the tokens) is
    multiplied by it. A weight outside (0, 1] would let a site outweigh the rest: it is excluded."""
    table = _table([1.0, 0, 0, 100], [1.0, 0, 0, 300], [1.0, 0, 0, 100], weights=[1.0, 0.5, 1.0])
    use = contributing_sites(table)
    assert use == [True, True, True]
    assert [site_weight(table, use, s, by_tokens=True) for s in range(3)] == pytest.approx([2 / 7, 3 / 7, 2 / 7])  # 100, 150, 100
    assert [site_weight(table, use, s, by_tokens=False) for s in range(3)] == pytest.approx([0.4, 0.2, 0.4])
    greedy = _table([1.0, 0, 0, 100], [1.0, 0, 0, 100], [1.0, 0, 0, 100], weights=[1.0, 5.0, 0.0])
    assert contributing_sites(greedy) == [True, False, False]


def test_contributors_nan_outlier_abstain_and_token_weights():

    table = _table([1.0, 0, 0, 100], [1.2, 0, 0, 300], [400.0, 0, 0, 100], [float("nan"), 3, 0, 100], [0.0, 0, 1, 0])
    use = contributing_sites(table, outlier_factor=10.0)
    assert use == [True, True, False, False, False]  # outlier (norm 20 vs ~1), NaN, abstainer
    assert site_weight(table, use, 1, by_tokens=True) == pytest.approx(0.75)
    assert site_weight(table, use, 0, by_tokens=False) == 0.5 and site_weight(table, use, 2, by_tokens=True) == 0.0


def test_rda_shares_divide_by_norms_and_rescale_to_the_mean_norm():

    from zeroband.comm.reduce import mean_norm, rda_scale

    # norms 1, 2, 4 and an abstainer
    table = _table([1.0, 0, 0, 100], [4.0, 0, 0, 100], [16.0, 0, 0, 200], [0.0, 0, 1, 0])
    use = [True, True, True, False]
    shares = [site_weight(table, use, s, by_tokens=False, merge="rda") for s in range(4)]
    assert shares == pytest.approx([4 / 7, 2 / 7, 1 / 7, 0.0])  # 1/norm, normalised: a sum of unit directions / 7
    by_tokens = [site_weight(table, use, s, by_tokens=True, merge="rda") for s in range(3)]
    assert by_tokens == pytest.approx([0.5, 0.25, 0.25])  # tokens/norm: 100, 50, 50 (/ 200)
    assert mean_norm(table, use, by_tokens=False) == pytest.approx(7 / 3)
    assert mean_norm(table, use, by_tokens=True) == pytest.approx(1 * 0.25 + 2 * 0.25 + 4 * 0.5)
    zero = _table([0.0, 0, 0, 1], [4.0, 0, 0, 1])  # no direction: no share
    assert [site_weight(zero, [True, True], s, False, "rda") for s in (0, 1)] == [0.0, 1.0]
    none = _table([0.0, 0, 0, 0], [0.0, 0, 0, 0])  # nobody has a direction: the mean's shares
    assert [site_weight(none, [True, True], s, False, "rda") for s in (0, 1)] == [0.5, 0.5]
    assert rda_scale(2.0, 0.25) == pytest.approx(4.0) and rda_scale(2.0, 0.0) == 1.0


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


def test_run_over_stops_only_sites_without_the_state_and_only_at_this_runs_end():
    end = {"steps": 20, "step": 20, "round": 10}
    assert not run_over(None, 20, fresh=True)  # no end published: the run goes on, join it
    assert run_over(end, 20, fresh=True)  # its finishing members published it: stop, never re-form it
    assert run_over(end, 12, fresh=True)  # a run that went past this site's own end
    assert not run_over(end, 40, fresh=True)  # an earlier, shorter run of this name (train.steps raised since)
    assert not run_over(end, 20, fresh=False)  # a site holding the state is the run: its own loop ends it


def test_run_complete_published_signed_missing_or_forged_reads_as_not_yet():
    address = f"tcp://127.0.0.1:{free_port()}"
    store = open_store(address, True, timedelta(seconds=10))
    liveness = Liveness(store, "p/", range(2), dead_after_s=0.5)
    key = b"k" * 32
    member, reader = (RoundCoordinator(store, "p/", site, site == 0, liveness, key) for site in (0, 1))
    assert reader.completed() is None  # missing: not yet
    store.set("p/complete", '{"steps": 20, "step": 20, "round": 10}')  # unsigned: not the members' word
    assert reader.completed() is None
    member.mark_complete(10, 20, 20)
    assert reader.completed() == {"steps": 20, "step": 20, "round": 10}
    RoundCoordinator(store, "p/", 1, False, liveness, key).mark_complete(11, 22, 22)  # only a site's rank 0 writes
    assert reader.completed() == {"steps": 20, "step": 20, "round": 10}


def test_a_waiting_joiner_stops_once_the_run_ends_instead_of_forming_it_again():
    """Two fresh sites wait at round 11, which nobody holding the state will decide: the last members
    committed the run's end (round 10) and left. Before, the two live joiners were `orphaned` and
    formed round 11 from their own state: the run again. Now the published end stops the waiting one."""
    address = f"tcp://127.0.0.1:{free_port()}"
    store = open_store(address, True, timedelta(seconds=10))
    beats = [Heartbeat(lambda: open_store(address, False, timedelta(seconds=10)), "p/", s, 0.05).start()
             for s in (1, 2)]
    liveness = Liveness(store, "p/", range(3), dead_after_s=2.0)
    rounds = RoundCoordinator(store, "p/", 1, True, liveness)  # the lowest live joiner: it would propose
    store.set("p/r11/a0/arrive/2", "fresh")  # the other joiner, alive and waiting too
    deadline = time.monotonic() + 5
    while liveness.alive_after_poll() != {1, 2} and time.monotonic() < deadline:
        time.sleep(0.05)
    rounds.mark_complete(10, 20, 20)  # site 0 committed the end and left

    def stop_if_over() -> None:  # ElasticMembership._stop_if_over, less the leave
        if (end := rounds.completed()) is not None and run_over(end, 20, fresh=True):
            raise RunComplete({"step": end["step"], "last_round": end["round"]})

    try:
        with pytest.raises(RunComplete, match="run already complete at step 20"):
            rounds.rendezvous(11, 0, set(), 1, 1.0, fresh=True, timeout_s=30, new_generation=lambda m: 1,
                              stop_if_over=stop_if_over)
        assert not store.check(["p/r11/a0/members"])  # no round past the end was formed
        rounds.rendezvous(11, 0, set(), 1, 1.0, fresh=True, timeout_s=30, new_generation=lambda m: 1)
        assert store.check(["p/r11/a0/members"])  # (what the same wait does without the check)
    finally:
        for beat in beats:
            beat.stop()


def test_one_proposer_per_attempt():
    from zeroband.membership.rounds import proposer

    assert proposer({0: "ready", 1: "ready"}, alive={0, 1}, r=3) == 0
    assert proposer({0: "fresh", 1: "ready"}, alive={0, 1}, r=3) == 1  # a joiner never proposes
    assert proposer({0: "ready", 1: "ready"}, alive={1}, r=3) == 1  # site 0 is dead: the next one takes over
    assert proposer({0: "fresh", 1: "fresh"}, alive={0, 1}, r=0) == 0  # at launch anyone may
    assert proposer({1: "fresh"}, alive={0, 1}, r=2) is None
