"""Who is the foreign site (issue 23): a site that decided a round alone and reads other slots'
heartbeats failing its key. The rule alone (pure), then its action on a real TCPStore."""

from __future__ import annotations

import pytest
import torch

from zeroband.membership.elastic import ElasticMembership, foreign_alone, refuse_if_foreign
from zeroband.membership.heartbeat import Liveness, heartbeat_key
from zeroband.membership.rounds import Decision
from zeroband.trust.signed import SignedStore
from zeroband.world import World

KEY, OTHER = b"k" * 32, b"o" * 32


@pytest.mark.parametrize("refused, slots, fresh, refuses", [
    (1, 3, True, False),  # the CI case: honest site 0, site 2 foreign, site 1 silent (late): trains on
    (2, 3, True, True),  # the foreign site, seeing both honest sites fail its key
    (1, 2, True, True),  # two slots: neither can tell, both stop naming the mismatch (a tie, fresh)
    (2, 3, False, True),  # a foreign site that started beside one honest site, once the third beats
    (1, 2, False, False),  # a site that trained alone is not stopped by a foreign newcomer (who is fresh)
    (0, 3, True, False),  # no failing beat: nothing to refuse
    (1, 4, True, False), (2, 4, True, True), (2, 5, True, False), (3, 5, True, True),
])
def test_a_site_alone_refuses_itself_only_when_the_failing_slots_are_the_majority(refused, slots, fresh, refuses):
    assert foreign_alone(refused, slots, fresh, had_peer=False) is refuses


def test_a_site_that_ever_had_a_peer_is_never_the_foreign_one():
    assert not any(foreign_alone(r, 3, fresh, had_peer=True) for r in (1, 2) for fresh in (True, False))


def _store() -> torch.distributed.Store:
    return torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _member(server: torch.distributed.Store, site: int, slots: int) -> ElasticMembership:
    """The attributes refuse_if_foreign reads while it lets the site go on (its refusal, which leaves
    the run, is proven by tests/integration/test_elastic.py::test_foreign_peer_refused)."""
    member = ElasticMembership.__new__(ElasticMembership)
    member.world = World(0, 1, 0, site, slots, torch.device("cpu"))
    member.prefix, member.fresh, member.had_peer = "p/", True, False
    member.liveness = Liveness(server, "p/", range(slots), 2.0, KEY, site)
    return member


def test_an_honest_site_alone_beside_a_foreign_beat_and_a_late_peer_trains_on():
    """Site 0 decided round 0 alone: site 2's beat (another secret) fails its key, site 1 has not
    started. It used to refuse itself as the foreign one ("site 0 (this site) refused")."""
    server = _store()
    SignedStore(server, OTHER).set(heartbeat_key("p/", 2), "n:1")
    member = _member(server, 0, 3)
    member.liveness.poll()
    assert set(member.liveness.store.refused) == {heartbeat_key("p/", 2)}
    refuse_if_foreign(member, Decision([0], [0], 1))  # goes on: no refusal, no leave


def test_once_a_decision_named_a_peer_the_site_is_never_refused_alone():
    """A decision with another site (its arrival signed with our key) proves the secret is shared:
    alone later, with both other slots failing our key (say restarted with another secret), the
    site trains on."""
    server = _store()
    member = _member(server, 0, 3)
    refuse_if_foreign(member, Decision([0, 1], [0, 1], 1))
    for s in (1, 2):
        SignedStore(server, OTHER).set(heartbeat_key("p/", s), "n:1")
    member.liveness.poll()
    refuse_if_foreign(member, Decision([0], [], 2))
    assert member.had_peer
