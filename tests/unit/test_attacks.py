"""Attacks on a multi-site run, each refused: real forked sites on loopback, real gloo and TCPStore.

Every rogue behaviour lives on the test side (tests/attackers.py: wrapped process groups and codecs,
a forger writing store values without the secret). An attack counts as refused when the honest
sites either go on with the right model, bitwise identical, or stop with a clear error; never when
they finish with a wrong or dead model.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
import torch

from tests.attackers import (
    forge_round_keys,
)
from tests.multiproc import free_port
from zeroband.comm.reduce import verified_sites
from zeroband.config import ConfigError
from zeroband.membership.heartbeat import Heartbeat, Liveness
from zeroband.membership.rounds import RoundCoordinator
from zeroband.store.client import open_store
from zeroband.trust.secret import RunSecret, resolve_secret
from zeroband.trust.signed import SignedStore

SECRET = "attack-tests-shared-secret-0123456789"

pytestmark = pytest.mark.timeout(60)


def test_verified_sites_rule():
    claims = torch.tensor([[1.0, 0, 0, 0, -1, 1]] * 4, dtype=torch.float64)
    w = [0.25] * 4
    sent = torch.tensor([[0.0625, 0], [0.06, 0], [0.0625 * 100, 0], [0.05, 1]], dtype=torch.float64)
    # site 2 sent 10x the norm it declared (above CLAIM_SLACK), site 3 sent a NaN
    assert verified_sites(claims, [True] * 4, w, sent) == [True, True, False, False]
    sent[2, 0] = 0.0625 * 9  # 3x its claim: within the slack, but an outlier among 3+ candidates
    assert verified_sites(claims, [True] * 4, w, sent, outlier_factor=2.0) == [True, True, False, False]
    assert verified_sites(claims, [True, False, True, True], w, sent) == [True, False, True, False]


# ---------------------------------------------------------------------- the store: forged keys
@pytest.fixture
def store():
    address = f"tcp://127.0.0.1:{free_port()}"
    host = open_store(address, True, timedelta(seconds=20))
    yield host
    del host


KEY, OTHER_KEY = b"k" * 32, b"x" * 32


def test_forged_heartbeat_and_leave_are_refused(store, caplog):
    caplog.set_level(logging.WARNING)
    beat = Heartbeat(lambda: store, "p/", 0, 0.05, KEY).start()
    liveness = Liveness(store, "p/", range(3), dead_after_s=2.0, sign_key=KEY)
    try:
        for i in range(10):  # site 2 never ran: a forger keeps its beat changing, unsigned or wrongly signed
            store.set("p/hb/2", f"x:{i}")
            SignedStore(store, OTHER_KEY).set("p/hb/1", f"y:{i}")
            store.set("p/leave/0", "3")
            liveness.poll()
            time.sleep(0.05)
        assert liveness.alive() == {0} and liveness.left == set()
    finally:
        beat.stop()
    refused = {r.key for r in caplog.records if getattr(r, "event", "") == "store_value_refused"}
    assert refused == {"p/hb/2", "p/hb/1", "p/leave/0"}  # each logged once, however often forged


def test_forged_members_votes_verdict_and_committed_are_refused(store):
    forged = forge_round_keys(store, "p/", rounds=1, sites=2)
    beats = [Heartbeat(lambda: store, "p/", s, 0.05, KEY).start() for s in (0, 1)]
    coordinators = []
    for s in (0, 1):
        liveness = Liveness(store, "p/", range(2), dead_after_s=2.0, sign_key=KEY)
        coordinators.append(RoundCoordinator(store, "p/", s, True, liveness, KEY))
    try:
        assert coordinators[0].committed_round() == -1  # the forged "100" reads as absent
        results: dict = {}

        def site(s: int) -> None:
            c = coordinators[s]
            decision = c.rendezvous(0, 0, {0, 1}, 1, 5.0, fresh=True, timeout_s=20, new_generation=lambda m: 1)
            results[s] = (decision, c.vote_and_verdict(0, 0, decision, True, timeout_s=20))

        threads = [threading.Thread(target=site, args=(s,)) for s in (0, 1)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        for s in (0, 1):
            decision, verdict = results[s]
            assert decision.members == [0, 1] and decision.generation == 1 and verdict == "commit"
        coordinators[0].mark_committed(0)
        assert coordinators[1].committed_round() == 0
        assert {"p/r0/a0/members", "p/r0/a0/verdict", "p/committed"} <= coordinators[0].store.refused.keys()
        assert forged == 9
    finally:
        [b.stop() for b in beats]


# ---------------------------------------------------------------------- policy
def test_multi_site_without_a_secret_needs_insecure(monkeypatch, caplog):
    monkeypatch.delenv("ZEROBAND_SECRET", raising=False)
    with pytest.raises(ConfigError, match="sites.secret: a 2-site run needs a shared secret.*sites.insecure"):
        resolve_secret(None, False, 2)
    assert resolve_secret(None, False, 1) is None  # one site talks to nobody
    caplog.set_level(logging.WARNING)
    assert resolve_secret(None, True, 2) is None and resolve_secret(None, True, 3) is None
    assert sum("NOT authenticated" in r.message for r in caplog.records) <= 1  # warned once per process
    assert resolve_secret(SECRET, True, 2) == RunSecret(SECRET.encode(), "x")  # a secret always wins
    with pytest.raises(ConfigError, match="sites.secret") as e:
        resolve_secret("short-42", False, 2)
    assert "short-42" not in str(e.value)
