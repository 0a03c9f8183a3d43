"""Message authentication for everything the global groups carry: a one-time key per message from the secret.

Each message ends with a 16-byte tag over its payload, under a key that belongs to that message alone:
    message key = HMAC-SHA256(tag key, label | group context | call number | gloo tag (phase + piece)
                              | source | destination)
    tag         = AES-256-GMAC(message key, fixed nonce, payload)   (AES-GCM over no plaintext)
The context is the group's store prefix, which names the run, the generation and the shard; the
call number counts the group's collectives, which every member runs in the same order. So a
message recorded in an earlier round or generation, sent by a site other than the one the
receiver expects, or sent to another site, is checked under another key and fails. A failed or
truncated message raises `WireAuthError` in Python, where the fault-tolerance code can catch it.

Without a secret (`sites.insecure = true`) `NO_AUTH` adds nothing, so messages keep the plain
format. The secret's key is derived once per process (scrypt, zeroband/membership/auth.py), never stored.

Why GMAC under a one-time key: GHASH runs on the CPU's carry-less multiplier (PCLMULQDQ, or
VPCLMULQDQ with AVX-512; PMULL on ARM) at ~20 GB/s on one core, against ~7 GB/s for keyed BLAKE3
(wire v2) and ~2 GB/s for HMAC-SHA256 (v1), measured on 1 MB fp16 messages on a Zen 4 EPYC; 4.2
GB/s on a Zen 3 one, without 512-bit carry-less multiplies (docs/results/outer_step.md). The outer step seals and opens every byte of its payload, so the tag
was the largest part of its local work. GMAC's one hazard is two different payloads tagged under
one key and nonce: that reveals the hash key. Here every key tags one message identity only, so
the worst a repeated identity could give away is that identity, which a receiver accepts once
anyway; no other message and no other round is exposed. 128-bit tags: a forgery succeeds with
probability ~ (payload blocks) / 2**128 per attempt.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from functools import cached_property

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from zeroband.membership.auth import TrustError, _frame, derive_key

LABEL = b"zeroband-wire-v3"  # v3: GMAC under a one-time key (v2: keyed BLAKE3, v1: HMAC-SHA256)
TAG_BYTES = 16
NONCE = bytes(12)  # fixed: every key tags one message identity only


class WireAuthError(TrustError):
    """A message from a peer failed authentication (forged, replayed, truncated or misrouted)."""


@dataclass(frozen=True)
class WireAuth:
    """Seals and opens messages with one key; `key=None` is the insecure no-op."""

    key: bytes | None = None

    @classmethod
    def from_secret(cls, secret: bytes | None, run_name: str) -> WireAuth:
        return cls(derive_key(secret, f"zeroband/{run_name}/wire") if secret else None)

    @property
    def tag_bytes(self) -> int:
        return TAG_BYTES if self.key else 0

    def subkey(self, purpose: str) -> bytes | None:
        """An independent key for another use of the same secret (e.g. store values)."""
        return hmac.new(self.key, LABEL + b"|" + purpose.encode(), hashlib.sha256).digest() if self.key else None

    @cached_property
    def mac_key(self) -> bytes:
        """The 32-byte key the one-time message keys come from (its own subkey: no other use shares it)."""
        return self.subkey("message-tags")

    def tag(self, context: bytes, fields: tuple[object, ...], payload: torch.Tensor) -> bytes:
        message_key = hmac.digest(self.mac_key, _frame(LABEL, context, *(str(f).encode() for f in fields)), "sha256")
        return AESGCM(message_key).encrypt(NONCE, b"", payload.numpy())  # the tensor's bytes, no copy

    def seal(self, buf: torch.Tensor, context: bytes, fields: tuple[object, ...]) -> torch.Tensor:
        """`buf` (uint8) followed by its tag; `buf` itself when there is no key."""
        if not self.key:
            return buf
        tag = torch.frombuffer(bytearray(self.tag(context, fields, buf)), dtype=torch.uint8)
        return torch.cat([buf, tag])

    def seal_tail(self, buf: torch.Tensor, context: bytes, fields: tuple[object, ...]) -> torch.Tensor:
        """`seal` without the copy: `buf` ends with `tag_bytes` spare bytes, which receive the tag."""
        if self.key:
            body = buf[: buf.numel() - TAG_BYTES]
            buf[body.numel() :] = torch.frombuffer(bytearray(self.tag(context, fields, body)), dtype=torch.uint8)
        return buf

    def open(self, buf: torch.Tensor, context: bytes, fields: tuple[object, ...]) -> torch.Tensor:
        """The payload of a sealed message; raises WireAuthError unless its tag verifies."""
        if not self.key:
            return buf
        body, tag = buf[:-TAG_BYTES], bytes(buf[-TAG_BYTES:].numpy())
        if not hmac.compare_digest(self.tag(context, fields, body), tag):
            call, tag, src, dst = fields
            raise WireAuthError(
                f"message of call {call} (tag {tag}) from site {src} to site {dst} failed authentication "
                "(forged, replayed from an earlier round, truncated, or sent by a site without the secret)"
            )
        return body


NO_AUTH = WireAuth(None)
