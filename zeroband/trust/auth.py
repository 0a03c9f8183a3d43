"""Admission: a site may join a generation only with the shared secret and the same config fingerprint.

Sites share nothing but the coordination store before their process groups exist, so the handshake
runs over the store, under the generation's own (fresh) prefix P:

1. every site i publishes a random 32-byte nonce N_i (write-once: a reused prefix is an error) and
   its fingerprint F_i (not secret: model/tokenizer/config values that must match);
2. every site i publishes, for each peer j, the proof
       HMAC-SHA256(K, "zeroband-admit-v1" | P | i | j | N_i | N_j | sha256(F_i)),
   with K = scrypt(secret, salt = label | P). The secret never leaves the process; the proofs are
   bound to both nonces and the prefix, so proofs recorded in an earlier generation (or copied from
   another site's slot) do not verify. scrypt makes each offline guess at the secret cost 16 MiB
   and its time (benchmarks/kernels.md), and a secret shorter than 16 bytes is refused (trust/secret.py);
3. every site reads all proofs, which are public, and checks every pair. Since all honest sites
   hold the same key and read the same write-once values, they reach the same verdict (`decide`);
4. the admitted members key this group's messages for this incarnation only: K_s from every
   member's nonce (`Admission.nonces`, trust/mac.py `WireAuth.for_session`). A proof verifies only
   if its author read the same two nonces as the verifier, so all admitted members derive the same
   K_s, and each member's own fresh nonce makes K_s new at every admission: a message recorded in
   an earlier incarnation (restart, resume) or generation is checked under another key.

Verdict rules: the sites whose proofs verify under our key form our "club". If it is not a strict
majority we cannot tell who holds the right secret, so we admit nobody. Within the club, the
fingerprint held by the most sites wins (ties: the one of the lowest site rank); sites with another
fingerprint are refused with the keys that differ.

The secret is the run's `RunSecret` (trust/secret.py, resolved once at start); it is never logged or
put in an error message, and nothing derived from it but the proofs is stored.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from zeroband.trust.secret import SECRET_ENV, RunSecret, as_secret

log = logging.getLogger(__name__)

SECRET_FIX = (f"fix: give every site the same secret ({SECRET_ENV}, or sites.secret_file with mode 0600), "
              "and the same config")
# Proofs bind the config fingerprint but verify only under the same secret: a site whose proofs fail
# may also differ in config, which cannot be told until the secret matches; the line says both.
WRONG_SECRET = ("wrong or missing shared secret (its admission proofs do not verify under this site's secret; "
                f"its config is compared only once the secret matches); {SECRET_FIX}")
MIN_SECRET_BYTES = 16
LABEL = b"zeroband-admit-v1"
NONCE_BYTES = 32


class TrustError(RuntimeError):
    """A peer failed a check of what it sent or who it is (refused admission, forged or replayed
    message, lying statistics, diverged replica): the run cannot go on as is. One clear line."""


class PeerRefused(TrustError):
    """Admission failed. Raised on every site, with the same `admitted`/`refused` on all honest ones."""

    def __init__(self, site: int, verdict: Verdict) -> None:
        self.site = site
        self.admitted = verdict.admitted
        self.refused = verdict.refused
        super().__init__(verdict.describe(site))


@dataclass(frozen=True)
class Verdict:
    admitted: list[int]
    refused: dict[int, str] = field(default_factory=dict)  # site -> why

    def describe(self, me: int) -> str:
        return "; ".join(
            f"site {s}{' (this site)' if s == me else ''} refused: {why}" for s, why in sorted(self.refused.items())
        )


def flatten_fingerprint(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config values as flat `a.b.c -> str` pairs, so a mismatch names the exact key."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_fingerprint(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return out


# ---- crypto (pure) --------------------------------------------------------------------------------

def _canonical(fingerprint: Mapping[str, str]) -> bytes:
    return json.dumps(dict(fingerprint), sort_keys=True, separators=(",", ":")).encode()


def frame(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: no two different field tuples give the same message."""
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def proof(key: bytes, prefix: str, prover: int, verifier: int, nonces: Mapping[int, bytes],
          fingerprint: Mapping[str, str]) -> str:
    """Hex HMAC by which `prover` shows `verifier` it holds the key, for this generation only."""
    msg = frame(LABEL, prefix.encode(), str(prover).encode(), str(verifier).encode(),
                 nonces[prover], nonces[verifier], hashlib.sha256(_canonical(fingerprint)).digest())
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def verified_sites(key: bytes, prefix: str, nonces: Mapping[int, bytes], fingerprints: Mapping[int, Mapping[str, str]],
                   proofs: Mapping[int, Mapping[int, str]]) -> set[int]:
    """Sites whose every published proof (to every peer) verifies under `key`."""
    sites = sorted(nonces)
    ok = set()
    for i in sites:
        expected = {j: proof(key, prefix, i, j, nonces, fingerprints[i]) for j in sites if j != i}
        given = proofs.get(i, {})
        if all(hmac.compare_digest(str(given.get(j, "")), want) for j, want in expected.items()):
            ok.add(i)
    return ok


# ---- decision (pure) ------------------------------------------------------------------------------

def decide(site_count: int, me: int, secret_ok: Iterable[int], fingerprints: Mapping[int, Mapping[str, str]]) -> Verdict:
    """Who is admitted, from who proved our secret and everybody's fingerprint. Deterministic:
    honest sites feed it identical inputs, so they agree."""
    club = sorted(set(secret_ok) | {me})  # our own proofs always verify under our own key
    if 2 * len(club) <= site_count:
        why = (f"wrong or missing shared secret, on this site or on the others: only sites {club} of {site_count} "
               f"prove the same secret, not a majority, so no site can be admitted (configs are compared only "
               f"once the secret matches); {SECRET_FIX}")
        return Verdict([], {me: why})
    refused = {s: WRONG_SECRET for s in range(site_count) if s not in club}
    reference = _winning_fingerprint(club, fingerprints)
    admitted = [s for s in club if _canonical(fingerprints[s]) == _canonical(reference)]
    theirs = "ours" if me in admitted else "agreed"
    for s in club:
        if s not in admitted:
            refused[s] = (f"config differs (the shared secret matches): {fingerprint_diff(fingerprints[s], reference, theirs)}; "
                          "fix: start every site with the same values for these keys")
    return Verdict(admitted, refused)


def _winning_fingerprint(club: list[int], fingerprints: Mapping[int, Mapping[str, str]]) -> Mapping[str, str]:
    """The fingerprint most sites of the club hold; a tie goes to the one of the lowest site rank."""
    votes: dict[bytes, list[int]] = {}
    for s in club:
        votes.setdefault(_canonical(fingerprints[s]), []).append(s)
    best = max(votes.values(), key=lambda holders: (len(holders), -holders[0]))
    return fingerprints[best[0]]


def fingerprint_diff(theirs: Mapping[str, str], reference: Mapping[str, str], label: str = "ours") -> str:
    """`model.dim 256 vs ours 128; tokenizer.vocab <missing> vs ours 8192`."""
    keys = sorted(set(theirs) | set(reference))
    diffs = [f"{k} {theirs.get(k, '<missing>')} vs {label} {reference.get(k, '<missing>')}"
             for k in keys if theirs.get(k) != reference.get(k)]
    return "; ".join(diffs)


# ---- protocol over the store ----------------------------------------------------------------------

@dataclass(frozen=True)
class Admission:
    admitted: list[int]
    nonces: dict[int, bytes]  # every member's fresh random nonce of this admission ({} without a secret)


def admit(store: dist.Store, prefix: str, site_rank: int, site_count: int, secret: RunSecret | bytes | None,
          fingerprint: Mapping[str, str], timeout: timedelta) -> list[int]:
    """`admission`'s admitted sites."""
    return admission(store, prefix, site_rank, site_count, secret, fingerprint, timeout).admitted


def admission(store: dist.Store, prefix: str, site_rank: int, site_count: int, secret: RunSecret | bytes | None,
              fingerprint: Mapping[str, str], timeout: timedelta) -> Admission:
    """Run the handshake for one generation on every site; returns the admitted sites (all of
    them) and the nonces the session key comes from, or raises PeerRefused everywhere if any site
    is refused. `prefix` must be fresh. Without a secret (sites.insecure) only the fingerprints
    are compared."""
    scoped = dist.PrefixStore(f"{prefix.rstrip('/')}/admit", store)  # PrefixStore adds the "/"
    fp = {str(k): str(v) for k, v in fingerprint.items()}
    sites = range(site_count)
    if secret is None:
        scoped.set(f"fingerprint/{site_rank}", _canonical(fp))  # type: ignore[arg-type]  # torch's Store stub says str; c10d stores take bytes
        fps = {s: json.loads(v) for s, v in _read_all(scoped, "fingerprint", sites, timeout).items()}
        verdict = decide(site_count, site_rank, sites, fps)
        if verdict.refused:
            raise PeerRefused(site_rank, verdict)
        return Admission(verdict.admitted, {})
    key = as_secret(secret).derive(prefix)
    # Every value is signed (trust/signed.py) with a key of the secret and this prefix, bound
    # to its store key (so to its writer's site): a forged nonce, fingerprint or proof reads as "not
    # yet" and is re-written by its owner, rather than failing the proofs and blaming an honest site.
    from zeroband.trust.signed import SignedStore  # it imports this module

    signed = SignedStore(scoped, hmac.digest(key, LABEL + b"|store-values", "sha256"))
    own = secrets.token_bytes(NONCE_BYTES)
    _publish_once(signed, f"nonce/{site_rank}", own.hex())
    bad: set[int] = set()  # sites whose values fail authentication (another secret): no proof will verify
    fps = {s: json.loads(v) if v else {} for s, v in _exchange(signed, "fingerprint", site_rank, sites, bad,
                                                                _canonical(fp), timeout).items()}
    # Our own nonce as drawn, never as read back: a transcript of an earlier admission replayed to
    # this site (old nonces, old valid proofs) then fails, and K_s always holds our fresh randomness.
    nonces = {s: bytes.fromhex(v.decode()) if v else b"" for s, v in _exchange(signed, "nonce", site_rank, sites, bad,
                                                                                own.hex(), timeout).items()}
    mine = {j: proof(key, prefix, site_rank, j, nonces, fp) for j in sites if j != site_rank}
    proofs = {s: {int(j): p for j, p in json.loads(v).items()} if v else {}
              for s, v in _exchange(signed, "proof", site_rank, sites, bad, json.dumps(mine), timeout).items()}
    verdict = decide(site_count, site_rank, verified_sites(key, prefix, nonces, fps, proofs), fps)
    if verdict.refused:
        raise PeerRefused(site_rank, verdict)
    return Admission(verdict.admitted, nonces)


def _publish_once(store: Any, key: str, value: str) -> None:
    """Write-once: a nonce already there means this prefix was used before, and reusing it would let
    old proofs be replayed. (A forged value does not count: the first authentic one wins.)"""
    if store.compare_set(key, "", value) != value.encode():
        raise RuntimeError(f"admission key {key!r} already exists: the generation prefix must be fresh")


def _read_all(store: dist.Store, kind: str, sites: Iterable[int], timeout: timedelta) -> dict[int, bytes]:
    from zeroband.watchdog import wait_keys

    keys = {s: f"{kind}/{s}" for s in sites}
    wait_keys(store, keys, f"admission: {kind}", timeout.total_seconds())
    return {s: store.get(k) for s, k in keys.items()}


ADMIT_REFUSE_S = 3.0  # a peer's values failing authentication this long: it holds another secret


def _exchange(store: Any, kind: str, me: int, sites: Iterable[int], bad: set[int], value: str | bytes,
              timeout: timedelta) -> dict[int, bytes | None]:
    """Every site's signed `kind` value; None for a site in `bad` or one whose values keep failing
    authentication for ADMIT_REFUSE_S (added to `bad`). One forged write is re-written by its owner
    well within that, so it delays the admission and blames nobody."""
    from zeroband.trust.signed import exchange

    keys = {s: f"{kind}/{s}" for s in sites if s not in bad}
    got = exchange(store, keys, me, value, f"admission: {kind}", timeout.total_seconds(), ADMIT_REFUSE_S)
    bad.update(s for s, v in got.items() if v is None)
    return {s: got.get(s) for s in sites}
