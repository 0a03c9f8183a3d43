"""Admission of sites: shared-secret challenge-response and config fingerprints over the store.

Pure tests of the proof check and the verdict, then three forked sites handshaking over a TCPStore.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

import pytest

from zeroband.trust.auth import (
    SECRET_ENV,
    WRONG_SECRET,
    decide,
    flatten_fingerprint,
    proof,
    verified_sites,
)
from zeroband.trust.secret import RunSecret, derive_key, resolve_secret

SECRET = b"correct horse battery staple 42"

WRONG = b"incorrect horse battery staple 7"

FP = {"model.dim": "128", "tokenizer.vocab": "8192", "seq_len": "256"}

SAME_VALUES = "fix: start every site with the same values for these keys"


def _round(keys: dict[int, bytes], prefix: str = "run/gen3/", fps: dict | None = None):
    """Nonces and proofs of one handshake where site s holds key keys[s]."""
    nonces = {s: secrets.token_bytes(32) for s in keys}
    fps = fps or {s: FP for s in keys}
    proofs = {i: {j: proof(keys[i], prefix, i, j, nonces, fps[i]) for j in keys if j != i} for i in keys}
    return nonces, fps, proofs


def test_proofs_verify_only_with_the_same_secret():
    good, bad = derive_key(SECRET, "run/gen3/"), derive_key(WRONG, "run/gen3/")
    nonces, fps, proofs = _round({0: good, 1: good, 2: bad})
    assert verified_sites(good, "run/gen3/", nonces, fps, proofs) == {0, 1}
    assert verified_sites(bad, "run/gen3/", nonces, fps, proofs) == {2}


def test_old_or_copied_proofs_do_not_verify():
    key = derive_key(SECRET, "run/gen3/")
    nonces, fps, proofs = _round({0: key, 1: key, 2: key})
    # replay: last generation's proofs against this generation's fresh nonces
    _, _, old = _round({0: key, 1: key, 2: key})
    assert verified_sites(key, "run/gen3/", nonces, fps, {**proofs, 2: old[2]}) == {0, 1}
    # an impostor in slot 2 copying site 0's proofs (addressed to 1 and 2) does not pass either
    copied = {1: proofs[0][1], 0: proofs[0][2]}
    assert verified_sites(key, "run/gen3/", nonces, fps, {**proofs, 2: copied}) == {0, 1}
    # proofs are bound to the prefix and to the prover's fingerprint
    assert verified_sites(key, "run/gen4/", nonces, fps, proofs) == set()
    assert verified_sites(key, "run/gen3/", nonces, {**fps, 1: {**FP, "seq_len": "512"}}, proofs) == {0, 2}


def test_decide_all_admitted():
    assert decide(3, 1, {0, 1, 2}, {s: FP for s in range(3)}).admitted == [0, 1, 2]


def test_decide_wrong_secret_is_refused_by_the_majority():
    fps = {s: FP for s in range(3)}
    for me in (0, 1):
        v = decide(3, me, {0, 1}, fps)
        assert v.admitted == [0, 1] and v.refused == {2: WRONG_SECRET}
    bad = decide(3, 2, {2}, fps)  # the odd one out cannot verify anybody: it admits nobody
    assert bad.admitted == [] and "not a majority" in bad.refused[2]
    # the line names both causes it cannot tell apart (whose secret is wrong; configs not compared) and the fix
    assert bad.refused[2].startswith("wrong or missing shared secret, on this site or on the others")
    assert "configs are compared only once the secret matches" in bad.refused[2] and "ZEROBAND_SECRET" in bad.refused[2]
    assert "config is compared only once the secret matches" in WRONG_SECRET and "sites.secret_file" in WRONG_SECRET


def test_decide_two_sites_that_disagree_admit_nobody():
    fps = {0: FP, 1: FP}
    for me in (0, 1):
        v = decide(2, me, {me}, fps)
        assert v.admitted == [] and list(v.refused) == [me]


def test_decide_fingerprint_majority_and_tie():
    other = {**FP, "model.dim": "256", "tokenizer.vocab": "4096"}
    v = decide(3, 0, {0, 1, 2}, {0: FP, 1: other, 2: FP})
    assert v.admitted == [0, 2]
    assert v.refused == {1: "config differs (the shared secret matches): model.dim 256 vs ours 128; tokenizer.vocab "
                            "4096 vs ours 8192; fix: start every site with the same values for these keys"}
    assert decide(3, 1, {0, 1, 2}, {0: FP, 1: other, 2: FP}).refused[1].endswith("vs agreed 8192; " + SAME_VALUES)
    tie = decide(4, 3, {0, 1, 2, 3}, {0: other, 1: FP, 2: other, 3: FP})  # 2 vs 2: site 0's wins
    assert tie.admitted == [0, 2] and set(tie.refused) == {1, 3}
    missing = decide(3, 0, {0, 1, 2}, {0: FP, 1: {"model.dim": "128"}, 2: FP})
    assert missing.refused[1] == ("config differs (the shared secret matches): seq_len <missing> vs ours 256; "
                                  "tokenizer.vocab <missing> vs ours 8192; " + SAME_VALUES)


def test_the_secret_is_resolved_into_one_object_that_never_shows_it(monkeypatch):
    """Issue 25: one resolution (config file / secret_file, else the environment) into a RunSecret
    that every user derives keys from; its repr, str and pickle never carry the value."""
    import pickle

    from zeroband.config import ConfigError

    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert resolve_secret(None) is None
    with pytest.raises(ConfigError, match=SECRET_ENV):
        resolve_secret(None, insecure=False, site_count=2)
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-123")
    env = resolve_secret(None, site_count=2)
    assert env.source == SECRET_ENV and env == RunSecret(b"from-the-environment-123", "x")
    config = resolve_secret("from-the-config-file-456")
    assert config.source == "sites.secret" and config != env  # the config's (a 0600 file) wins
    assert env.derive("run/gen3/") == derive_key(b"from-the-environment-123", "run/gen3/")  # keys unchanged
    for shown in (repr(env), str(env), f"{env}", f"{env!r}"):
        assert "from-the-environment" not in shown and "hidden" in shown
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(env)
    with pytest.raises(ConfigError, match="at least 16") as err:
        resolve_secret("hunter2")
    assert "hunter2" not in str(err.value)


def test_flatten_fingerprint():
    tree = {"model": {"dim": 128, "norm": "rms"}, "tokenizer": {"vocab": 8192}, "tied": True}
    assert flatten_fingerprint(tree) == {"model.dim": "128", "model.norm": "rms", "tokenizer.vocab": "8192",
                                         "tied": "true"}


def test_reused_prefix_is_rejected():
    """Write-once nonces: running a second handshake under the same prefix would allow replays."""
    import torch.distributed as dist

    from zeroband.trust import admit

    store = dist.HashStore()
    admit(store, "p/", 0, 1, SECRET, FP, timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="must be fresh"):
        admit(store, "p/", 0, 1, SECRET, FP, timedelta(seconds=5))


def test_session_keys_are_new_at_every_admission_and_each_identity_is_sealed_once():
    import torch

    from zeroband.trust.mac import TAG_BYTES, SealGuard, WireAuth, WireAuthError

    auth, body = WireAuth.from_secret(SECRET, "run"), torch.arange(64, dtype=torch.uint8)
    with pytest.raises(WireAuthError, match="no session key yet"):
        auth.seal(body, b"ctx", (1, 7, 0, 1))  # before admission nothing goes out
    first = auth.for_session(b"ctx", {0: b"a" * 32, 1: b"b" * 32})
    again = auth.for_session(b"ctx", {0: b"a" * 32, 1: b"c" * 32})  # a restart: site 1 drew another nonce
    assert first.session != again.session
    sealed = first.seal(body, b"ctx", (1, 7, 0, 1))
    assert torch.equal(first.open(sealed, b"ctx", (1, 7, 0, 1)), body) and sealed.numel() == 64 + TAG_BYTES
    with pytest.raises(WireAuthError, match="failed authentication"):
        again.open(sealed, b"ctx", (1, 7, 0, 1))  # recorded in one incarnation, refused in the next
    with pytest.raises(WireAuthError, match="twice under one session key"):
        first.seal(body + 1, b"ctx", (1, 7, 0, 1))  # one key+nonce, two payloads: never
    first.seal(body, b"ctx", (1, 7, 0, 2))  # another destination: another identity
    for call in range(2, 2 + SealGuard.WINDOW):
        first.seal(body, b"ctx", (call, 7, 0, 1))
    with pytest.raises(WireAuthError, match="twice"):
        first.seal(body, b"ctx", (1, 8, 0, 1))  # older than the window: refused, not forgotten


def test_replayed_admission_transcript_is_refused():
    """An on-path attacker replays an earlier incarnation's admission to site 0: its own nonce read
    back as the old one, site 1's old nonce and proofs. Site 0 keys with the nonce it drew, so the
    old proofs fail and it refuses, rather than agreeing on the old session key."""
    import threading

    import torch.distributed as dist

    from tests.attackers import ReplayingStore
    from zeroband.trust.auth import PeerRefused, admission

    earlier, timeout = dist.HashStore(), timedelta(seconds=10)
    threads = [threading.Thread(target=admission, args=(earlier, "p/", s, 2, SECRET, FP, timeout)) for s in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    now = dist.HashStore()
    for key in ("nonce/1", "proof/1", "fingerprint/1"):  # site 1's slots, filled from the recording
        now.set(f"p/admit/{key}", earlier.get(f"p/admit/{key}"))
    lying = ReplayingStore(now, {"p/admit/nonce/0": earlier.get("p/admit/nonce/0")})
    with pytest.raises(PeerRefused, match="only sites \\[0\\] of 2 prove the same secret"):
        admission(lying, "p/", 0, 2, SECRET, FP, timeout)
