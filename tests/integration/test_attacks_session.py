"""Attacks on the start broadcast and on message keys across incarnations (issue 23, items 1 and 2).

Real forked sites on loopback, real gloo, TCPStore and admission. The attacker sits on the WAN path
(tests/attackers.py: a tamperer on a site's received broadcasts, a tap on its sends that records
and substitutes whole sealed messages); it never holds the secret. An incarnation is one start of
the same fixed run: the same secret, run name and store prefix, a fresh store, group and admission.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

from tests.attackers import WireTap, tamper_start_broadcast
from tests.helpers import _train, tiny_overrides
from tests.multiproc import free_port, run_sites

SECRET = "session-tests-shared-secret-0123456789"
SHAPES = [(40, 25), (300,), (7,)]
VICTIM = (0, 0, 1 << 24)  # (round, destination, tag): site 1's first reduce-scatter piece to site 0, round 0

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- item 1: the start broadcast
def _tampered_start(tree: dict) -> dict:
    from zeroband.trust.auth import TrustError

    report = tamper_start_broadcast(repeats=64) if int(os.environ["ZEROBAND_SITE_RANK"]) == 1 else {}
    try:
        _train(tree)
        return {"error": None, **report}
    except TrustError as e:
        return {"error": str(e), **report}


@pytest.mark.parametrize("mode", ["diloco", "data_parallel"])
def test_start_broadcast_altered_with_a_crc_preserving_delta_stops_every_site(corpus, tmp_path, mode):
    """The issue's attack: sign flips on site 1's copy of site 0's parameters, chosen so that CRC32
    stays the same. Both sites used to train on to exit 0 with different replicas."""
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 2, "global_batch": 2, "micro_batch": 2})
    tree["diloco"] = {"inner_steps": 2, "mode": mode, "comm_dtype": "fp32"}
    tree["sites"] = {"store": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 20}
    out = run_sites(_tampered_start, 2, 1, (tree,), env={"ZEROBAND_SECRET": SECRET}, timeout=55)
    assert out[(1, 0)]["flipped"] == 960 and out[(1, 0)]["crc_kept"]  # the attack happened, CRC-neutral
    for s in (0, 1):
        error = out[(s, 0)]["error"]
        assert error is not None and "\n" not in error, out
        assert error.startswith("initial broadcast: the parameters that sites [1] received from site 0 failed "
                                "authentication"), error
    assert not (tmp_path / "t" / "checkpoints").exists()  # nobody trained on


# ---------------------------------------------------------------------- item 2: keys per incarnation
def grads_of(site: int, round_: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * round_ + site)
    return [torch.randn(s, generator=g) * 1e-2 for s in SHAPES]


def _incarnation(port: int, rounds: list[int], swap_in: dict | None) -> dict:
    """One incarnation of a 2-site run (fresh store and admission, the same secret, run and prefix):
    an average per round number in `rounds` (a resumed run starts past 0). Site 1's sends pass a tap;
    `swap_in` maps (round index, dst, tag) to what the attacker sends instead: ("replay", recorded
    sealed bytes) or ("xor", bytes to XOR into the live sealed message)."""
    import torch.distributed as dist

    import zeroband.trust.mac as mac
    from zeroband.comm.group import new_global_group
    from zeroband.comm.reduce import SiteStats, reduce_across_sites
    from zeroband.membership.base import admit_group

    def swap(key: tuple, live: torch.Tensor) -> torch.Tensor | None:
        kind, data = swap_in.get(key, (None, None))
        return data if kind == "replay" else live.bitwise_xor(data) if kind == "xor" else None

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    used: set[tuple[bytes, bytes]] = set()  # every (GMAC key, nonce) this process tags with

    class Recording:
        def __init__(self, key: bytes) -> None:
            self.key, self.aead = key, honest(key)

        def encrypt(self, nonce: bytes, data: bytes, associated_data: object) -> bytes:
            used.add((self.key, bytes(nonce)))
            return self.aead.encrypt(nonce, data, associated_data)

    honest, mac.AESGCM = mac.AESGCM, Recording  # at the real seal and open calls
    timeout = timedelta(seconds=5 if site else 20)
    store = dist.TCPStore("127.0.0.1", port, is_master=site == 0, timeout=timeout, wait_for_workers=False)
    out: dict = {"rounds": 0, "error": None}
    try:
        group = new_global_group(store, "zeroband/session/gen0/shard0/", site, 2, timeout,
                                 auth=mac.WireAuth.from_secret(SECRET.encode(), "session"))
        admit_group(group, store, SECRET.encode(), {}, 20)
        tap = group.pg = WireTap(group.pg, swap if swap_in and site == 1 else None)
        for k, round_ in enumerate(rounds):
            tap.round = k
            grads = grads_of(site, round_)
            stats = SiteStats(float(sum(g.double().square().sum() for g in grads)), 0.0)
            reduce_across_sites(grads, stats, group, "fp16", 4 * 500)
            out["rounds"] += 1
        out["sent"] = tap.sent
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["used"] = used
    time.sleep(0.5 if site == 0 else 0)  # site 0 hosts the store: let site 1 finish with it
    return out


def _run(rounds: list[int], swap_in: dict | None = None) -> dict:
    res = run_sites(_incarnation, 2, 1, (free_port(), rounds, swap_in), timeout=50)
    return {s: res[(s, 0)] for s in (0, 1)}


def _refused(out: dict) -> None:
    error = out[0]["error"]
    assert error is not None and error.startswith("WireAuthError: message of call 1 (tag 16777216) from site 1 to site 0 "
                                                  "failed authentication"), error
    assert out[0]["rounds"] == 0


def test_message_recorded_in_an_earlier_incarnation_is_refused():
    """A restart of the same fixed run: round 0 again, with other pseudo-gradients; the attacker sends
    the first incarnation's round-0 message in place of the new one."""
    first = _run([0, 1])
    assert first[0]["error"] is None and first[1]["error"] is None
    second = _run([7, 8], swap_in={VICTIM: ("replay", first[1]["sent"][VICTIM])})
    _refused(second)


def test_message_from_an_earlier_round_is_refused_after_a_resume():
    """A resumed run counts its collectives from 1 again: its first round (round 5) has the call
    number of round 0 of the first incarnation, whose message the attacker replays."""
    first = _run([0, 1])
    second = _run([5, 6], swap_in={VICTIM: ("replay", first[1]["sent"][VICTIM])})
    _refused(second)


def test_tag_forged_from_recorded_incarnations_is_refused():
    """GMAC under one key and nonce is linear: for equal-length messages, tag(a ^ b ^ c) = tag(a) ^
    tag(b) ^ tag(c). With the same keys in every incarnation, two recorded messages and the live one
    XOR into a new message with a valid tag, forged without the secret. Now the (key, nonce) pairs
    of two incarnations are disjoint, and the forgery fails."""
    a, b = _run([0, 1]), _run([2, 3])
    for s in (0, 1):
        assert a[s]["error"] is None and b[s]["error"] is None
        assert a[s]["used"] and not a[s]["used"] & b[s]["used"], "a GMAC key+nonce pair was used in both"
    recorded = a[1]["sent"][VICTIM].bitwise_xor(b[1]["sent"][VICTIM])
    c = _run([4, 5], swap_in={VICTIM: ("xor", recorded)})
    _refused(c)
