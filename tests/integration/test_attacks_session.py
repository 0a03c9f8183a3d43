"""Attacks on the start broadcast and on messages across incarnations (issue 23 items 1-2, over TLS 1.3
since issue 35).

Real forked sites on loopback, real transport, TCPStore and admission. The attacker sits on the WAN
path (tests/attackers.py `Capture`: a relay in a site's process on every connection it dials, which
rewrites bytes); it never holds the secret. An incarnation is one start of the same fixed run: the
same secret, run name and store prefix, a fresh store, group and admission.
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta

import pytest
import torch

from tests.attackers import Capture, on_path
from tests.helpers import _train, tiny_overrides
from tests.multiproc import free_port, run_sites

SECRET = "session-tests-shared-secret-0123456789"
SHAPES = [(40, 25), (300,), (7,)]
PAST_HANDSHAKE = 4000  # bytes of a connection: its TLS handshake and the transport's hello take ~1 kB

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- item 1: the start broadcast
def _tampered_start(tree: dict) -> dict:
    capture = Capture(on_path("alter", to_target=False, after=PAST_HANDSHAKE)) if os.environ["ZEROBAND_SITE_RANK"] == "1" else None
    try:
        _train(tree)
        return {"error": None}
    except Exception as e:  # the point: one Python error per site, never an abort
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if capture is not None:
            capture.close()


@pytest.mark.parametrize("mode", ["diloco", "data_parallel"])
def test_start_broadcast_altered_on_the_wire_stops_every_site(corpus, tmp_path, mode):
    """The issue's attack on the path: a byte of site 0's parameters flipped on their way to site 1.
    Both sites used to train on to exit 0 with different replicas (a CRC-neutral change); then the
    broadcast was sealed; now TLS refuses the record, site 1 applies nothing, and both stop."""
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 2, "global_batch": 2, "micro_batch": 2})
    tree["diloco"] = {"inner_steps": 2, "mode": mode, "comm_dtype": "fp32"}
    tree["sites"] = {"store": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 20, "streams": 1, "probe_s": 0}
    out = run_sites(_tampered_start, 2, 1, (tree,), env={"ZEROBAND_SECRET": SECRET}, timeout=55)
    errors = [out[(s, 0)]["error"] for s in (0, 1)]
    assert all(e is not None and "\n" not in e for e in errors), errors
    assert "connection to site 0: a TLS record failed authentication" in errors[1], errors
    assert not (tmp_path / "t" / "checkpoints").exists()  # nobody trained on


# ---------------------------------------------------------------------- item 2: keys per incarnation
def grads_of(site: int, round_: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * round_ + site)
    return [torch.randn(s, generator=g) * 1e-2 for s in SHAPES]


def _incarnation(port: int, rounds: list[int], recorded: bytes | None) -> dict:
    """One incarnation of a 2-site run (fresh store and admission, the same secret, run and prefix):
    an average per round number in `rounds`. Site 1's connection to site 0 crosses the attacker,
    which keeps what it carried and, given `recorded` (an earlier incarnation's bytes), sends them
    into this one past the handshake."""
    import torch.distributed as dist

    from zeroband.comm.group import new_global_group
    from zeroband.comm.reduce import SiteStats, reduce_across_sites
    from zeroband.membership.base import admit_group
    from zeroband.trust.mac import WireAuth

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    capture = Capture(on_path("inject", True, PAST_HANDSHAKE, recorded or b"") if recorded and site == 1 else None)
    timeout = timedelta(seconds=5 if site else 20)
    store = dist.TCPStore("127.0.0.1", port, is_master=site == 0, timeout=timeout, wait_for_workers=False)
    out: dict = {"rounds": 0, "error": None}
    try:
        group = new_global_group(store, "zeroband/session/gen0/shard0/", site, 2, timeout,
                                 auth=WireAuth.from_secret(SECRET.encode(), "session"))
        admit_group(group, store, SECRET.encode(), {}, 20)
        for round_ in rounds:
            grads = grads_of(site, round_)
            stats = SiteStats(float(sum(g.double().square().sum() for g in grads)), 0.0)
            reduce_across_sites(grads, stats, group, "fp16", 4 * 500)
            out["rounds"] += 1
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    # Neither closes its connections while the other may still read from them: a socket closed with
    # unread bytes in it is reset, and the reset can overtake the last bytes sent to the peer (site 0
    # then read "closed by the peer" in a clean run, under load).
    store.set(f"done/{site}", "1")
    with contextlib.suppress(Exception):  # a site stopped by the attack may never come
        store.wait([f"done/{1 - site}"], timedelta(seconds=10))
    out["wire"] = max(capture.wire(), key=len, default=b"")  # site 1: its stream to site 0 (the larger)
    capture.close()
    time.sleep(0.5 if site == 0 else 0)  # site 0 hosts the store: let site 1 finish with it
    return out


def _run(rounds: list[int], recorded: bytes | None = None) -> dict:
    res = run_sites(_incarnation, 2, 1, (free_port(), rounds, recorded), timeout=50)
    return {s: res[(s, 0)] for s in (0, 1)}


def test_bytes_recorded_in_an_earlier_incarnation_are_refused():
    """A restart of the same fixed run: the attacker sends the first incarnation's records (past the
    handshake: the transport's messages) into the second's connection. TLS 1.3 keys every connection
    afresh (ECDHE), so they fail there: site 0 stops at the first injected record."""
    first = _run([0, 1])
    assert first[0]["error"] is None and first[1]["error"] is None and len(first[1]["wire"]) > PAST_HANDSHAKE
    second = _run([0, 1], recorded=first[1]["wire"][PAST_HANDSHAKE:])
    error = second[0]["error"]
    assert error is not None and "connection to site 1: a TLS record failed authentication" in error, error
    assert second[0]["rounds"] < 2  # round 0 may be through before the injection
