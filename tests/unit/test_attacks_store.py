"""Attacks on the coordination store (issue 23, items 3, 4 and 9).

An outsider who can reach the store but holds no secret (tests/attackers.py `StoreForger`) writes
and deletes the keys that steer a fixed run: the arrival marks, the admission values, the resume
agreement. Real forked sites, real TCPStore (hosted by site 0), real gloo; the forger is a thread
of the test process with its own store connection. Key names are those of both the old layout
(`.../gen0/shard0/...`) and the new one (`.../shard0/start/<incarnation>/...`, found by listing
the store), so every test attacks either code. After each attack the honest sites must finish with
identical replicas and the right step count, or stop with one line naming the attack.
"""

from __future__ import annotations

import time

import pytest

SECRET = "store-attack-tests-shared-secret-0123"

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv("ZEROBAND_SECRET", SECRET)  # to read the signed checkpoints back


def _tcp_store():
    import torch.distributed as dist

    from tests.multiproc import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    return server, lambda: dist.TCPStore("127.0.0.1", port, is_master=False)


def _delete_in_a_loop(store, keys: list[str], stop, period_s: float = 0.05) -> None:
    while not stop.wait(period_s):
        for key in keys:
            store.delete_key(key)


def test_deleted_values_are_written_back_and_a_storm_is_named():
    """Unit: what a site wrote comes back after a deletion (only into an empty key: a newer value is
    never rolled back), and a wait whose keys keep vanishing stops after storm_after_s naming the
    attack, although this fresh site would otherwise wait join_timeout_s (here 3600 s)."""
    import threading

    from zeroband.membership.heartbeat import Liveness
    from zeroband.membership.rounds import RoundCoordinator
    from zeroband.trust.signed import STORM, KeepingStore, Ledger, SignedStore, StoreInterference

    server, client = _tcp_store()
    ledger, key = Ledger(), b"k" * 32
    kept = SignedStore(KeepingStore(client(), ledger, "p/"), key)
    kept.set("p/a", "1")
    kept.set("q/other", "x")  # outside the prefix: not ours to keep
    server.delete_key("p/a")
    server.delete_key("q/other")
    assert ledger.restore(server) == 1 and kept.read("p/a") == b"1" and not server.check(["q/other"])
    server.delete_key("p/a")
    server.set("p/a", "newer")
    assert ledger.restore(server) == 0 and server.get("p/a") == b"newer"

    ledger, store = Ledger(), KeepingStore(client(), Ledger(), "p/")
    store.ledger = ledger
    liveness = Liveness(store, "p/", [0, 1], dead_after_s=60.0, sign_key=key)
    liveness.seen[1] = (1, time.monotonic())  # site 1 is alive but never arrives
    rounds = RoundCoordinator(store, "p/", 0, True, liveness, key, ledger, storm_after_s=1.0)
    stop = threading.Event()
    deleter = threading.Thread(target=_delete_in_a_loop, args=(client(), ["p/r3/a0/arrive/0"], stop), daemon=True)
    deleter.start()
    began = time.monotonic()
    try:
        with pytest.raises(StoreInterference, match=f"store keys of round 3 {STORM}"):
            rounds.rendezvous(3, 0, {0, 1}, 1, 0.0, True, 3600.0, lambda members: 1)
    finally:
        stop.set()
    assert time.monotonic() - began < 5.0 and ledger.restored > 0


def test_a_deleted_heartbeat_is_no_death_and_generations_are_never_reused():
    """Unit: a live site whose beat was deleted just before a poll (after a long inner step) is not
    dead: absence is "no news" for dead_after_s, and its next beat is accepted. A dead site whose
    beat an attacker deletes is still dropped. A generation counter deleted (back to 1) never hands
    out a generation number this site has seen."""
    from zeroband.membership.elastic import fresh_generation
    from zeroband.membership.heartbeat import Liveness, heartbeat_key
    from zeroband.trust.signed import SignedStore

    server, client = _tcp_store()
    key = b"k" * 32
    beats = SignedStore(client(), key)
    seen = Liveness(client(), "p/", [1], dead_after_s=0.5, sign_key=key)
    beats.set(heartbeat_key("p/", 1), "n:1")
    seen.poll()
    time.sleep(0.6)  # a long inner step: no poll
    server.delete_key(heartbeat_key("p/", 1))
    assert seen.dead_among([1]) == set()  # deleted: no news, not a death
    beats.set(heartbeat_key("p/", 1), "n:2")
    assert seen.dead_among([1]) == set()
    server.delete_key(heartbeat_key("p/", 1))  # the site dies, and its beat is deleted
    seen.poll()
    time.sleep(0.6)  # absent for dead_after_s of polling
    assert seen.dead_among([1]) == {1}

    assert fresh_generation(server, "p/generation", 0) == 1
    server.delete_key("p/generation")
    assert fresh_generation(server, "p/generation", 7) == 8 and fresh_generation(server, "p/generation", 8) == 9


def test_a_generation_whose_group_never_formed_is_not_handed_out_again():
    """Unit (issue 23, the etcd storm's refusal): under a deletion storm the forming of generation 1
    failed, its counter was deleted, and the retry was handed generation 1 again, whose prefix still
    held the first try's admission values (signed, so they verify): a site read its peer's old nonce
    and every proof failed, "wrong or missing shared secret". A decision's generation counts as
    seen when it is read, not only once its group is formed."""
    from zeroband.membership.elastic import ElasticMembership

    server, _ = _tcp_store()
    member = ElasticMembership.__new__(ElasticMembership)  # only the generation bookkeeping runs
    member.store, member.prefix, member.group, member.members, member.generation = server, "p/", None, [], -1
    member.newest_generation = -1
    member.newest_generation = max(member.newest_generation, member._next_generation([0, 1]))  # as _decide does
    assert member.newest_generation == 1  # its group never formed: member.generation stays -1
    server.delete_key("p/generation")
    assert member._next_generation([0, 1]) == 2


@pytest.mark.parametrize("attack", ["deleted", "overwritten"])
def test_a_value_attacked_after_its_writer_moved_on_comes_back(attack):
    """Unit: site 1 read site 0's value and moved on; an outsider then deletes site 1's value, or
    overwrites it with a forged one, before site 0 read it. Site 0 used to wait until sites.timeout_s
    and blame site 1 (the forged resume offer of CI's test_forged_resume_agreement_is_ignored, when
    site 1 was slow to read under load). Now site 1's Republisher (a thread on its own connection, as
    in the fixed mode's start) writes it back."""
    from zeroband.trust.signed import KeepingStore, Ledger, Republisher, SignedStore, exchange

    server, client = _tcp_store()
    key, keys = b"k" * 32, {0: "p/x/0", 1: "p/x/1"}
    SignedStore(client(), key).set(keys[0], "a")
    ledger = Ledger()
    republisher = Republisher(client, ledger, keep_s=30.0).start()
    try:
        assert exchange(SignedStore(KeepingStore(client(), ledger, "p/"), key), keys, 1, "b", "test", 5.0)[0] == b"a"
        if attack == "deleted":  # after site 1 moved on
            server.delete_key(keys[1])
        else:
            server.set(keys[1], "[2]")
        began = time.monotonic()
        assert exchange(SignedStore(client(), key), keys, 0, "a", "test", 5.0)[1] == b"b"
        assert time.monotonic() - began < 1.0 and ledger.restored >= 1
    finally:
        republisher.stop()


def test_an_arrival_deleted_at_each_read_is_never_taken_for_a_foreign_one():
    """Unit (comm/group.py incarnation_prefix): site 1's honest arrival is deleted just before each
    of site 0's reads and written back by its owner just after, the interleaving a deletion storm hits
    by chance. Site 0 used to read it missing, then check the key, find it present and count it as
    failing authentication: after ADMIT_REFUSE_S it stopped with "written without the shared secret",
    blaming site 1. One read now gives value and presence together: a deletion is only "not yet"."""
    import torch.distributed as dist

    from zeroband.comm.group import incarnation_prefix
    from zeroband.trust.auth import ADMIT_REFUSE_S
    from zeroband.trust.signed import SignedStore
    from zeroband.watchdog import PeerTimeout

    class DeletedAtEachRead(dist.Store):
        def __init__(self, inner: dist.Store, key: str) -> None:
            super().__init__()
            self.inner, self.key = inner, key

        def compare_set(self, key: str, expected: str, desired: str) -> bytes:
            if key != self.key:
                return self.inner.compare_set(key, expected, desired)
            owner_wrote = self.inner.get(key)
            self.inner.delete_key(key)  # the outsider, just before our read
            try:
                return self.inner.compare_set(key, expected, desired)
            finally:
                self.inner.set(key, owner_wrote)  # the owner's re-publication, just after

        def set(self, key: str, value: str | bytes) -> None:
            self.inner.set(key, value)

        def get(self, key: str) -> bytes:
            return self.inner.get(key)

        def check(self, keys: list[str]) -> bool:
            return self.inner.check(keys)

    server, client = _tcp_store()
    key = b"k" * 32
    SignedStore(client(), key).set("run/arrive/1", "site 1's nonce")  # honest: signed with the run's key
    store = DeletedAtEachRead(client(), "run/arrive/1")
    with pytest.raises(PeerTimeout, match="site 1 did not arrive"):
        incarnation_prefix(store, "run/", 0, 2, timeout_s=ADMIT_REFUSE_S + 2, key=key)


def test_a_value_deleted_between_the_wait_and_the_read_of_a_get_is_waited_for():
    """Unit (trust/signed.py `wait_and_read`): c10d's get waits for the key, then reads it, and a key
    deleted between the two reads as b"". SignedStore.get and SealedStore.get (the gloo rendezvous)
    refused that as a forged value: under the elastic deletion storm on a loaded machine, sites
    stopped with ForgedValue on a data-ledger key (membership/data.py reads positions with get).
    An outsider deletes the key and its owner writes it back, in a tight loop: every get now
    returns the value."""
    import threading

    from zeroband.trust.signed import SealedStore, SignedStore

    server, client = _tcp_store()
    key, stop = b"k" * 32, threading.Event()
    sealed = SignedStore(server, key).seal("p/ledger/r1/s0/k0", "12,0")
    writer = client()

    def storm() -> None:
        while not stop.is_set():
            writer.set("p/ledger/r1/s0/k0", sealed)
            writer.delete_key("p/ledger/r1/s0/k0")

    thread = threading.Thread(target=storm, daemon=True)
    thread.start()
    try:
        signed, rendezvous = SignedStore(client(), key), SealedStore(client(), key)
        for _ in range(100):
            assert signed.get("p/ledger/r1/s0/k0") == b"12,0"
            assert rendezvous.get("p/ledger/r1/s0/k0") == b"12,0"
    finally:
        stop.set()
        thread.join()


def test_the_republisher_connects_in_the_caller_and_stop_leaves_nothing_in_flight():
    """Unit (issue 23, a launched fixed site aborted at exit: "terminate called without an active
    exception"): the start's Republisher used to connect from its daemon thread, where a c10d connect
    can retry in C++ past stop()'s join, and the process then finalized under it. Now start() opens
    the connection in the caller's thread, the thread restores deleted values over it, and stop()
    joins the thread and drops the connection."""
    import threading

    from zeroband.trust.signed import KeepingStore, Ledger, Republisher

    server, client = _tcp_store()
    opened_in: list[str] = []

    def open_client():
        opened_in.append(threading.current_thread().name)
        return client()

    ledger = Ledger()
    KeepingStore(client(), ledger, "p/").set("p/start", "kept")
    rep = Republisher(open_client, ledger, keep_s=10.0, interval_s=0.02).start()
    assert opened_in == [threading.current_thread().name] and rep.store is not None
    server.delete_key("p/start")
    deadline = time.monotonic() + 5
    while not server.check(["p/start"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.get("p/start") == b"kept"  # written back over the caller's connection
    rep.stop()
    assert not rep.thread.is_alive() and rep.store is None


def test_a_member_whose_beat_was_never_read_is_not_dead_yet():
    """Unit: under a storm a site's beat can be deleted before every read; it was dead at once (an
    attempt failed with "sites [1] stopped responding", even naming the observing site itself, and a
    proposer left it out as dead). Now a beat never read gives dead_after_s from when it was found
    missing, and the observer is always alive."""
    from zeroband.membership.heartbeat import Liveness

    _, client = _tcp_store()
    seen = Liveness(client(), "p/", [1], dead_after_s=0.5, sign_key=b"k" * 32)
    assert seen.dead_among([1]) == set()  # every beat of site 1 deleted before a read, so far
    time.sleep(0.6)  # still no beat of site 1 after dead_after_s: now it is dead
    assert seen.dead_among([1]) == {1}
    observer = Liveness(client(), "p/", [0, 1], dead_after_s=0.5, sign_key=b"k" * 32, me=0)
    observer.poll()
    time.sleep(0.6)
    assert observer.dead_among([0, 1]) == {1} and observer.alive() == {0}  # its own beat deleted: still alive


def test_one_site_proposes_and_every_reader_keeps_the_member_list():
    """Unit: a deleted member list left its write-once slot empty for a second proposer, and the
    two sites decided different lists (different members or generations) for the same attempt. Now
    only the lowest live site that arrived holding the state proposes, and every site that read
    the list writes it back when it is deleted."""
    import threading

    from zeroband.membership.heartbeat import Liveness
    from zeroband.membership.rounds import RoundCoordinator, RoundTimeout
    from zeroband.trust.signed import KeepingStore, Ledger

    server, client = _tcp_store()
    key = b"k" * 32

    def site(s: int) -> RoundCoordinator:
        ledger = Ledger()
        store = KeepingStore(client(), ledger, "p/")
        liveness = Liveness(store, "p/", [0, 1], dead_after_s=60.0, sign_key=key)
        liveness.seen.update({0: (1, time.monotonic()), 1: (1, time.monotonic())})  # both sites alive
        return RoundCoordinator(store, "p/", s, True, liveness, key, ledger)

    first, second = site(0), site(1)
    first.store.set("p/r1/a0/arrive/0", "ready")  # site 0 arrived, then went quiet
    with pytest.raises(RoundTimeout):  # site 1 sees both arrived, yet leaves the proposal to site 0
        second.rendezvous(1, 0, {0, 1}, 1, 0.0, False, 1.0, lambda members: 9)
    out: dict = {}
    reader = threading.Thread(target=lambda: out.update(second=second.rendezvous(1, 0, {0, 1}, 1, 0.0, False, 10.0,
                                                                                 lambda members: 9)))
    reader.start()
    decided = first.rendezvous(1, 0, {0, 1}, 1, 0.0, False, 10.0, lambda members: 7)
    reader.join()
    assert decided == out["second"] and decided.members == [0, 1] and decided.generation == 7
    server.delete_key("p/r1/a0/members")
    assert second.ledger.restore(server) >= 1 and second.store.read("p/r1/a0/members") is not None


def test_a_site_that_missed_a_committed_round_proposes_nothing_for_it():
    """Unit: site 1 decided and committed round 2 alone, its member list deleted before site 0 read
    it; site 0 then proposed itself alone for the same round, and the two sites went on with
    different replicas (both exited 0). Now a round already committed is never proposed again: the
    site is left behind, and joins the next boundary."""
    from zeroband.membership.heartbeat import Liveness
    from zeroband.membership.rounds import RoundCoordinator
    from zeroband.trust.signed import SignedStore

    _, client = _tcp_store()
    key = b"k" * 32
    SignedStore(client(), key).set("p/committed", "3")  # round 2 is committed (without site 0)
    liveness = Liveness(client(), "p/", [0, 1], dead_after_s=60.0, sign_key=key)
    liveness.seen[0] = (1, time.monotonic())
    rounds = RoundCoordinator(client(), "p/", 0, True, liveness, key)
    with pytest.raises(Exception, match="round 2 was committed without this site"):
        rounds.rendezvous(2, 1, {0}, 1, 0.0, False, 2.0, lambda members: 5)
    assert rounds.store.read("p/r2/a1/members") is None


def test_under_deletions_a_live_site_is_never_dropped_as_late():
    """Unit: site 0 waited grace_s for site 1, whose arrival (and member list) had been deleted before
    site 0 read them, and proposed itself alone while site 1 decided with itself: two sites committed
    the round apart, with different replicas. Once values were deleted, a live expected site is
    waited for until it arrives or dies (or the storm is named), never dropped for being late."""
    from zeroband.membership.heartbeat import Liveness
    from zeroband.membership.rounds import RoundCoordinator, RoundTimeout
    from zeroband.trust.signed import Ledger

    _, client = _tcp_store()
    key, ledger = b"k" * 32, Ledger()
    ledger.restored = 1  # a value of this site was deleted and written back: the store is under attack
    liveness = Liveness(client(), "p/", [0, 1], dead_after_s=60.0, sign_key=key)
    liveness.seen.update({0: (1, time.monotonic()), 1: (1, time.monotonic())})  # site 1 alive, not arrived
    rounds = RoundCoordinator(client(), "p/", 0, True, liveness, key, ledger)
    with pytest.raises(RoundTimeout):
        rounds.rendezvous(2, 0, {0, 1}, 1, 0.0, False, 1.0, lambda members: 5)
    assert rounds.store.read("p/r2/a0/members") is None


def test_under_deletions_no_beat_is_a_death_and_a_deleted_leave_notice_holds():
    """Unit (issue 23 item 4, the etcd storm on a starved CPU): a live site's beats went unread past
    dead_after_s (deleted, or its heartbeat thread starved) and it was taken for dead. Now a beat of
    a site already seen that goes missing is a deletion seen (nobody honest deletes one), and while
    deletions are seen no beat, missing or stale, is a death: only a leave notice is, and a deleted
    notice does not bring the site back until it beats again. Once the storm window has passed,
    beats decide again."""
    from zeroband.membership.heartbeat import Liveness, heartbeat_key, leave_key
    from zeroband.trust.signed import Ledger, SignedStore

    # a prefix of its own: failed once in a full run (the deletion not seen); the likely cause is a
    # "p/" heartbeat of another test (other key: present but refused) reaching a store on a reused port
    P = "p-no-beat-death/"
    server, client = _tcp_store()
    key, ledger = b"k" * 32, Ledger()
    beats, beat = SignedStore(client(), key), heartbeat_key(P, 1)
    seen = Liveness(client(), P, [1], dead_after_s=0.3, sign_key=key, ledger=ledger, storm_window_s=60.0)
    beats.set(beat, "n:1")
    seen.poll()
    assert not ledger.deleting(60.0)
    server.delete_key(beat)
    seen.poll()
    assert ledger.deleting(60.0)  # a beat read before is gone: the store is under attack
    time.sleep(0.4)
    assert seen.dead_among([1]) == set()  # missing past dead_after_s: no death under deletions
    beats.set(beat, "n:1")
    assert seen.dead_among([1]) == set()  # back, but stale (never a newer beat): no death either
    beats.set(leave_key(P, 1), "3")
    assert seen.dead_among([1]) == {1}  # it said goodbye: gone at once
    server.delete_key(leave_key(P, 1))
    assert seen.dead_among([1]) == {1}  # its notice deleted: still gone
    beats.set(beat, "n:2")
    assert seen.dead_among([1]) == set()  # it beats again (restarted): back
    ledger.deleted_at = time.monotonic() - 61.0  # the storm window has passed
    time.sleep(0.4)
    assert seen.dead_among([1]) == {1}  # a stale beat is a death again


def test_under_deletions_neither_site_of_a_pair_decides_a_round_alone():
    """Unit (issue 23 item 4): under an etcd storm and two busy loops, each site's beats went unread
    past dead_after_s; each took the other for dead, proposed itself alone for round 3 (the other's
    list deleted before it read it), committed it, and the two replicas diverged (both exited 0).
    Now, while deletions are seen, a site seen before is never dead by its beats, and (should a
    site still look dead) a member list must hold a majority of the last round's members that have
    not left (`storm_quorum`): both sites wait, bounded by the timeout, instead of going on alone."""
    from zeroband.membership.heartbeat import Liveness
    from zeroband.membership.rounds import RoundCoordinator, RoundTimeout
    from zeroband.trust.signed import KeepingStore, Ledger

    server, client = _tcp_store()
    key = b"k" * 32

    def site(s: int, beats_judged_by_storm: bool) -> RoundCoordinator:
        ledger = Ledger()
        ledger.noticed()  # deletions were seen
        store = KeepingStore(client(), ledger, "p-pair-majority/")
        liveness = Liveness(store, "p-pair-majority/", [0, 1], dead_after_s=0.2, sign_key=key, me=s,
                            ledger=ledger if beats_judged_by_storm else None, storm_window_s=60.0)
        liveness.seen.update({0: (1, time.monotonic() - 10), 1: (1, time.monotonic() - 10)})  # no beat read for 10 s
        return RoundCoordinator(store, "p-pair-majority/", s, True, liveness, key, ledger, storm_after_s=60.0)

    for round_, by_storm in ((3, True), (4, False)):  # the liveness rule, then the quorum rule alone
        with pytest.raises(RoundTimeout):
            site(0, by_storm).rendezvous(round_, 0, {0, 1}, 1, 0.0, False, 1.0, lambda members: 5)
        server.delete_key(f"p/r{round_}/a0/members")  # a list [0] would be deleted before site 1 read it
        server.delete_key(f"p/r{round_}/a0/arrive/0")  # and site 0's arrival
        with pytest.raises(RoundTimeout):
            site(1, by_storm).rendezvous(round_, 0, {0, 1}, 1, 0.0, False, 1.0, lambda members: 6)
        assert server.check([f"p/r{round_}/a0/members"]) is False


def test_a_lone_site_keeps_its_leave_notice_up_for_three_of_its_polls():
    """Unit: under deletions the first site to exit had read its peer's notice, but the peer had not
    read its own (deleted between the peer's slow polls, under load): the peer, no beat being a
    death, lingered sites.timeout_s (20 s of a 6-step test). Now a site alone keeps its notice up
    for dead_after_s, or three of its slowest polls if longer."""
    from zeroband.membership.elastic import linger_tail_s

    assert linger_tail_s(2.0, 0.1) == 2.0 and linger_tail_s(2.0, 2.4) == pytest.approx(7.2)


def test_a_value_signed_in_one_incarnation_is_refused_in_another(monkeypatch):
    """Issue 35: a signature bound a value to its key only, so a `complete` (or a ledger position)
    recorded from an earlier launch verified in a new one. Under `incarnation_key` the same key and
    bytes verify only in the launch that wrote them; an unbound value is refused as well."""
    import torch.distributed as dist

    from zeroband.config import ConfigError
    from zeroband.trust.signed import INCARNATION_ENV, SignedStore, incarnation_key, run_incarnation

    store, key, name = dist.HashStore(), b"k" * 32, "zeroband/r/elastic/complete"
    old, new = (SignedStore(store, incarnation_key(key, i)) for i in ("launch-one", "launch-two"))
    old.set(name, b'{"steps": 4, "step": 4, "round": 2}')
    assert old.read(name) is not None and new.read(name) is None and new.refused == {name: "bad-mac"}
    SignedStore(store, incarnation_key(key, "")).set(name, b"x")  # a launch without an id: the bare key
    assert new.read(name) is None and incarnation_key(key, "") == key and incarnation_key(None, "a") is None
    monkeypatch.setenv(INCARNATION_ENV, "a/../b")  # part of store keys: refused, naming the variable
    with pytest.raises(ConfigError, match=INCARNATION_ENV):
        run_incarnation()
    monkeypatch.delenv(INCARNATION_ENV)
    assert run_incarnation() == ""
