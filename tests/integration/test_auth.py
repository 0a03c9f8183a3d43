"""Admission of sites: shared-secret challenge-response and config fingerprints over the store.

Pure tests of the proof check and the verdict, then three forked sites handshaking over a TCPStore.
"""

from __future__ import annotations

import base64
import os
from datetime import timedelta

from tests.multiproc import run_sites
from tests.unit import test_auth as unit_tier  # what both tiers share is defined there, once
from zeroband.trust.auth import (
    WRONG_SECRET,
)
from zeroband.trust.secret import derive_key

FP = unit_tier.FP
SAME_VALUES = unit_tier.SAME_VALUES
SECRET = unit_tier.SECRET
WRONG = unit_tier.WRONG


def _site(secrets_by_site: dict[int, bytes], fps_by_site: dict[int, dict], prefix: str) -> dict:
    from zeroband.store import open_store
    from zeroband.trust import PeerRefused, admit

    site, sites = int(os.environ["ZEROBAND_SITE_RANK"]), int(os.environ["ZEROBAND_SITE_COUNT"])
    store = open_store(os.environ["ZEROBAND_TEST_STORE"], site == 0, timedelta(seconds=30))
    try:
        out = {"admitted": admit(store, prefix, site, sites, secrets_by_site[site], fps_by_site[site],
                                 timedelta(seconds=30))}
    except PeerRefused as e:
        out = {"error": str(e), "admitted": e.admitted, "refused": e.refused}
    store.set(f"done/{site}", b"1")
    if site == 0:  # hosts the TCP server: stay until everybody is done, then dump every value
        store.wait([f"done/{s}" for s in range(sites)], timedelta(seconds=30))
        out["values"] = {k: store.get(k) for k in store.list_keys()}
    return out


def _run(secrets_by_site: dict[int, bytes], fps_by_site: dict[int, dict]) -> dict[int, dict]:
    results = run_sites(_site, 3, 1, (secrets_by_site, fps_by_site, "zeroband/test/gen1/"), timeout=60)
    return {site: r for (site, _), r in results.items()}


def test_same_secret_all_admitted_and_secret_never_stored():
    out = _run({s: SECRET for s in range(3)}, {s: FP for s in range(3)})
    assert all(r["admitted"] == [0, 1, 2] and "error" not in r for r in out.values()), out
    values = out[0]["values"]
    assert any(k.endswith("proof/2") for k in values) and any(k.endswith("nonce/0") for k in values)
    forms = [SECRET, SECRET.hex().encode(), base64.b64encode(SECRET), derive_key(SECRET, "zeroband/test/gen1/")]
    for key, value in values.items():
        assert not any(f in value or f in key.encode() for f in forms), key


def test_wrong_secret_refused_by_all_others():
    out = _run({0: SECRET, 1: SECRET, 2: WRONG}, {s: FP for s in range(3)})
    for site in (0, 1):
        assert out[site]["error"] == "site 2 refused: " + WRONG_SECRET
        assert out[site]["admitted"] == [0, 1]
    assert "site 2 (this site) refused" in out[2]["error"]


def test_different_fingerprint_refused_naming_the_keys():
    other = {**FP, "model.dim": "256", "tokenizer.vocab": "4096"}
    out = _run({s: SECRET for s in range(3)}, {0: FP, 1: other, 2: FP})
    for site in (0, 2):
        assert out[site]["error"] == ("site 1 refused: config differs (the shared secret matches): model.dim 256 vs "
                                      "ours 128; tokenizer.vocab 4096 vs ours 8192; " + SAME_VALUES)
        assert out[site]["admitted"] == [0, 2]
    assert out[1]["error"] == ("site 1 (this site) refused: config differs (the shared secret matches): model.dim "
                               "256 vs agreed 128; tokenizer.vocab 4096 vs agreed 8192; " + SAME_VALUES)
