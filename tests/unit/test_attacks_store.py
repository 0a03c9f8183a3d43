"""Attacks on the coordination store (issue 23, items 3, 4 and 9).

The protocol's own rules, each on a real c10d TCPStore in this process: what a site reads is
judged by its signature and its presence in one read, one site proposes an attempt's member list,
a round already committed is never proposed again, a value signed in one launch verifies in no
other. (Nobody without the run's credentials reaches a tcp:// store's keys at all:
tests/integration/test_store_outsider.py.)
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


def test_an_arrival_forged_after_it_was_read_does_not_unarrive_its_site():
    """Unit (comm/group.py incarnation_prefix, trust/signed.py `remember`): site 0 reads site 1's
    signed arrival and writes its hash; site 1 would then leave its own wait and stop re-writing its
    mark. An outsider overwrites that mark for longer than ADMIT_REFUSE_S before site 1's hash lands.
    Site 0 used to read the mark afresh, take site 1 for missing again, and stop the start with
    "written without the shared secret" (the fixed-run attack test failed so in CI under load). An
    arrival that verified once stays arrived: site 0 returns the prefix site 1 agreed to."""
    import threading

    from zeroband.comm.group import incarnation_prefix
    from zeroband.trust.auth import ADMIT_REFUSE_S
    from zeroband.trust.signed import SignedStore

    server, client = _tcp_store()
    key = b"k" * 32
    site1 = SignedStore(client(), key)
    site1.set("run/arrive/1", "site 1's nonce")
    got: dict[str, object] = {}

    def site0() -> None:
        try:
            got["prefix"] = incarnation_prefix(client(), "run/", 0, 2, timeout_s=ADMIT_REFUSE_S + 20, key=key)
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            got["prefix"] = e

    thread = threading.Thread(target=site0, daemon=True)
    thread.start()
    agreed = site1.get("run/nonces/0")  # site 0 has read site 1's arrival
    client().set("run/arrive/1", b"forged: no valid HMAC")
    time.sleep(ADMIT_REFUSE_S + 1)
    site1.set("run/nonces/1", agreed)
    thread.join(timeout=20)
    assert got.get("prefix") == f"run/{agreed.decode()}/", got


def test_a_value_forged_after_its_site_left_the_exchange_is_put_back():
    """Unit (trust/signed.py `exchange`, `Keeper`): site 1 reads site 0's value and leaves the
    exchange before site 0 has read site 1's; an outsider then overwrites site 1's value. Site 1 used
    to stop re-writing it once it left, so site 0 saw only the forgery and, after the refusal delay,
    refused an honest site (the fixed-run admission attack test, once in CI under load). Site 1 now
    keeps its value for the wait's timeout: site 0 reads site 1's own value."""
    from zeroband.trust.signed import SignedStore, exchange

    server, client = _tcp_store()
    key, keys = b"k" * 32, {0: "run/admit/nonce/0", 1: "run/admit/nonce/1"}
    SignedStore(client(), key).set(keys[0], "site 0's")  # site 0 wrote, then was descheduled
    left = exchange(SignedStore(client(), key), keys, 1, "site 1's", "test", timeout_s=10, refuse_after_s=1.0)
    assert left == {0: b"site 0's", 1: b"site 1's"}
    client().set(keys[1], b"forged: no valid HMAC")  # after site 1 left its wait
    got = exchange(SignedStore(client(), key), keys, 0, "site 0's", "test", timeout_s=10, refuse_after_s=1.0)
    assert got == {0: b"site 0's", 1: b"site 1's"}


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


def test_a_member_whose_beat_was_never_read_is_not_dead_yet():
    """Unit: a site whose beat was never read (not started yet) gets dead_after_s from when it was
    found missing, and the observer is always alive, whatever its own key holds."""
    from zeroband.membership.heartbeat import Liveness

    _, client = _tcp_store()
    seen = Liveness(client(), "p/", [1], dead_after_s=0.5, sign_key=b"k" * 32)
    assert seen.dead_among([1]) == set()  # no beat of site 1 yet
    time.sleep(0.6)  # still no beat of site 1 after dead_after_s: now it is dead
    assert seen.dead_among([1]) == {1}
    observer = Liveness(client(), "p/", [0, 1], dead_after_s=0.5, sign_key=b"k" * 32, me=0)
    observer.poll()
    time.sleep(0.6)
    assert observer.dead_among([0, 1]) == {1} and observer.alive() == {0}  # no beat of its own: still alive


def test_one_site_proposes_and_every_site_reads_its_member_list():
    """Unit: only the lowest live site that arrived holding the state proposes; every site reads
    the list it wrote."""
    import threading

    from zeroband.membership.heartbeat import Liveness
    from zeroband.membership.rounds import RoundCoordinator, RoundTimeout

    _, client = _tcp_store()
    key = b"k" * 32

    def site(s: int) -> RoundCoordinator:
        store = client()
        liveness = Liveness(store, "p/", [0, 1], dead_after_s=60.0, sign_key=key)
        liveness.seen.update({0: (1, time.monotonic()), 1: (1, time.monotonic())})  # both sites alive
        return RoundCoordinator(store, "p/", s, True, liveness, key)

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


def test_a_site_that_missed_a_committed_round_proposes_nothing_for_it():
    """Unit: site 1 decided and committed round 2 without site 0, which came late. A round already
    committed is never proposed again (the two sites would go on with different replicas): the
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
