"""Message authentication for everything the global groups carry, under a key of this incarnation only.

Key schedule (docs/security.md):
    K        = scrypt(secret, run)                             once per process, never on the wire
    K_s      = HMAC-SHA256(K', label | prefix | N_0 | ... | N_{S-1})      per group, per incarnation
    key_m    = HMAC-SHA256(K_s, label | prefix | call | gloo tag (phase + piece) | source | destination)
    tag      = AES-256-GMAC(key_m, zero nonce, payload)              (AES-GCM over no plaintext)
K' is K's message subkey; the prefix names the run, the generation and the shard; N_i is the
32-byte random nonce member i drew for this admission (zeroband/trust/auth.py), whose proofs
bind every nonce, so every admitted member derives the same K_s and nobody else can. Every start
(fresh, resumed, restarted) and every elastic generation runs a new admission, so K_s is new each
time: a message recorded in another incarnation, generation or shard is checked under another key
and fails. The call number counts the group's collectives (every member runs them in the same
order), so one recorded in an earlier round of the same incarnation fails too; so does one sent by
another site than the receiver expects, or to another site.

No GMAC key+nonce pair is ever used twice, which is GMAC's one hazard (two payloads tagged under
one key and nonce give away the hash key, and from three an XOR forgery needs no key at all):
- K_s is new at every admission: it includes this site's own fresh 256-bit nonce, so no peer,
  store or attacker can make it repeat (a repeat is a 2**-256 accident);
- under one K_s every message identity (call, tag, source, destination) is tagged once:
  `SealGuard` refuses a second seal of an identity, and of any call older than its window, so a
  bug that would reuse an identity stops the run instead of weakening it;
- key_m is a PRF of K_s and the identity, so distinct identities get independent one-time keys,
  each used with the one fixed nonce once.
A failed or truncated message raises `WireAuthError` in Python, where the fault-tolerance code can
catch it. Before its admission a group's auth (`key` without `session`) seals and opens nothing:
it raises, so no message can go out under a key that is not this incarnation's.

Without a secret (`sites.insecure = true`) `NO_AUTH` adds nothing, so messages keep the plain
format.

Why GMAC under a one-time key: GHASH runs on the CPU's carry-less multiplier (PCLMULQDQ, or
VPCLMULQDQ with AVX-512; PMULL on ARM), several times faster than keyed BLAKE3 (wire v2) or
HMAC-SHA256 (v1); the measurements, per CPU, are in docs/results/outer_step.md (2026-11-24). The
outer step seals and opens every byte of its payload, so the tag was the largest part of its local work.
128-bit tags: a forgery succeeds with probability ~ (payload blocks) / 2**128 per attempt.

`replica_digest` is the keyed digest replica checks compare (HMAC-SHA256; not CRC32, which is
linear: a delta with zero CRC contribution changes the bytes and keeps the checksum).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import cast

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from zeroband.trust.auth import TrustError, frame
from zeroband.trust.secret import RunSecret, as_secret

LABEL = b"zeroband-wire-v4"  # v4: one-time keys under a per-incarnation session key (v3: under the secret's key)
SESSION_LABEL = b"zeroband-session-v1"
DIGEST_LABEL = b"zeroband-replica-digest-v1"
TAG_BYTES = 16
NONCE = bytes(12)  # fixed: every key tags one message identity only (see the module docstring)
AESGCM_MAX = (1 << 31) - 1  # the one-shot AESGCM takes at most this many bytes; longer goes incrementally


class WireAuthError(TrustError):
    """A message from a peer failed authentication (forged, replayed, truncated or misrouted)."""


def gmac(key: bytes, nonce: bytes, data: memoryview | bytes) -> bytes:
    """AES-GMAC of `data` (read in place). A start broadcast or a state hand-over of a large model
    can exceed what the one-shot AESGCM takes: those go to GCM in slices (the same tag)."""
    if len(data) <= AESGCM_MAX:
        return AESGCM(key).encrypt(nonce, b"", data)  # one call: the fast path for messages
    ctx = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    view = memoryview(data).cast("B")
    for start in range(0, len(view), 1 << 30):
        ctx.authenticate_additional_data(view[start : start + (1 << 30)])
    ctx.finalize()
    return ctx.tag


class SealGuard:
    """Refuses to tag a message identity twice under one session key (the GMAC key+nonce rule).

    Call numbers only grow, but two collectives of one group may seal at once (an overlapped outer
    step next to a check), so the guard keeps the identities of the last `WINDOW` calls and refuses
    every call at or below the oldest it forgot: a repeat is either remembered or too old."""

    WINDOW = 64

    def __init__(self) -> None:
        self.calls: dict[int, set[tuple[object, ...]]] = {}
        self.floor = 0  # calls <= floor are refused
        self.lock = threading.Lock()

    def claim(self, fields: tuple[object, ...]) -> None:
        call, rest = int(cast(int, fields[0])), fields[1:]  # the call number leads every message
        with self.lock:
            seen = self.calls.setdefault(call, set()) if call > self.floor else None
            if seen is None or rest in seen:
                raise WireAuthError(f"refusing to seal message {fields} twice under one session key")
            seen.add(rest)
            if len(self.calls) > self.WINDOW:
                self.floor = min(self.calls)
                del self.calls[self.floor]


@dataclass(frozen=True)
class WireAuth:
    """Seals and opens messages. `key=None`: the insecure no-op. `key` without `session`: a group
    whose admission has not run yet, which refuses to seal or open anything (`for_session`)."""

    key: bytes | None = None  # from the secret and the run name (scrypt, once per process)
    tags: bool = True  # False: the group's channel authenticates every byte itself (TLS, comm/transport.py)
    session: bytes | None = None  # K_s: this group's key in this incarnation
    guard: SealGuard = field(default_factory=SealGuard, compare=False, repr=False)

    @classmethod
    def from_secret(cls, secret: RunSecret | bytes | None, run_name: str) -> WireAuth:
        secret = as_secret(secret)
        return cls(secret.derive(f"zeroband/{run_name}/wire") if secret is not None else None)

    def for_session(self, context: bytes, nonces: Mapping[int, bytes]) -> WireAuth:
        """This auth keyed for one admitted group: K_s from every member's admission nonce. Called
        once per admission (the nonces are write-once per prefix), so one guard sees every seal."""
        if not self.sealing:
            return self
        members = [nonces[s] for s in sorted(nonces)]
        session = hmac.digest(self.mac_key, frame(SESSION_LABEL, context, *members), "sha256")
        return replace(self, session=session, guard=SealGuard())

    @property
    def sealing(self) -> bool:
        """Messages carry tags: a secret, and a channel that does not authenticate them (nccl)."""
        return bool(self.key) and self.tags

    @property
    def tag_bytes(self) -> int:
        return TAG_BYTES if self.sealing else 0

    def subkey(self, purpose: str) -> bytes | None:
        """An independent key for another use of the same secret (e.g. store values)."""
        return hmac.new(self.key, LABEL + b"|" + purpose.encode(), hashlib.sha256).digest() if self.key else None

    @cached_property
    def mac_key(self) -> bytes:
        """The 32-byte key the session keys come from (its own subkey: no other use shares it)."""
        key = self.subkey("message-tags")
        assert key is not None, "no secret, no message tags"  # callers check self.key first
        return key

    def tag(self, context: bytes, fields: tuple[object, ...], payload: torch.Tensor) -> bytes:
        if self.session is None:
            raise WireAuthError(f"message {fields}: no session key yet (the group's admission has not run)")
        message_key = hmac.digest(self.session, frame(LABEL, context, *(str(f).encode() for f in fields)), "sha256")
        return gmac(message_key, NONCE, payload.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer; numpy declares __buffer__ only for python >= 3.12

    def _seal_tag(self, context: bytes, fields: tuple[object, ...], payload: torch.Tensor) -> torch.Tensor:
        tag = self.tag(context, fields, payload)  # raises before the claim without a session
        self.guard.claim(fields)
        return torch.frombuffer(bytearray(tag), dtype=torch.uint8)

    def seal(self, buf: torch.Tensor, context: bytes, fields: tuple[object, ...]) -> torch.Tensor:
        """`buf` (uint8) followed by its tag; `buf` itself when nothing is sealed."""
        if not self.sealing:
            return buf
        return torch.cat([buf, self._seal_tag(context, fields, buf)])

    def seal_tail(self, buf: torch.Tensor, context: bytes, fields: tuple[object, ...]) -> torch.Tensor:
        """`seal` without the copy: `buf` ends with `tag_bytes` spare bytes, which receive the tag."""
        if self.sealing:
            body = buf[: buf.numel() - TAG_BYTES]
            buf[body.numel() :] = self._seal_tag(context, fields, body)
        return buf

    def open(self, buf: torch.Tensor, context: bytes, fields: tuple[object, ...]) -> torch.Tensor:
        """The payload of a sealed message; raises WireAuthError unless its tag verifies."""
        if not self.sealing:
            return buf
        body, tag = buf[:-TAG_BYTES], bytes(buf[-TAG_BYTES:].numpy())
        if buf.numel() < TAG_BYTES or not hmac.compare_digest(self.tag(context, fields, body), tag):
            call, what, src, dst = fields
            raise WireAuthError(
                f"message of call {call} (tag {what}) from site {src} to site {dst} failed authentication "
                "(forged, replayed from an earlier round or incarnation, truncated, or sent by a site without "
                "the secret)"
            )
        return body

    def replica_digest(self, tensors: list[torch.Tensor]) -> bytes:
        """16-byte keyed digest of the tensors' bytes, for replica checks (see `replica_digest`)."""
        return replica_digest(tensors, self.subkey("replica-digest"))


NO_AUTH = WireAuth(None)
PUBLIC_DIGEST_KEY = bytes(32)  # sites.insecure: nothing is authenticated, the digest still compares bytes


def replica_digest(tensors: list[torch.Tensor], key: bytes | None) -> bytes:
    """HMAC-SHA256 (truncated to 16 bytes) of the tensors' sizes and bytes, read in place.

    Sites compare it to prove they hold the same bytes. Unlike CRC32 nobody without the key can
    choose a change that keeps it, and unlike GMAC it has no nonce, so the same key may digest every
    replica check of the run (it stays stable across incarnations, like the `outer_crc` metric
    that chaos runs compare). It reads every byte once (its rate on one core: benchmarks/kernels.md),
    so these checks run at the start, at hand-overs, and per step only with `diloco.log_checksum`."""
    h = hmac.new(key or PUBLIC_DIGEST_KEY, DIGEST_LABEL, hashlib.sha256)
    for t in tensors:
        view = t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
        h.update(len(view).to_bytes(8, "big"))
        h.update(view)  # type: ignore[arg-type]  # an ndarray is a buffer; numpy declares __buffer__ only for python >= 3.12
    return h.digest()[:16]
