"""Message authentication for everything the global groups carry: keyed BLAKE3 under a key from the secret.

Each message ends with a 32-byte tag over
    (label, group context, call number, gloo tag (phase + piece), source, destination, payload).
The context is the group's store prefix, which names the run, the generation and the shard; the
call number counts the group's collectives, which every member runs in the same order. So a
message recorded in an earlier round or generation, sent by a site other than the one the
receiver expects, or sent to another site, fails verification. A failed or truncated message
raises `WireAuthError` in Python, where the fault-tolerance code can catch it.

Without a secret (`sites.insecure = true`) `NO_AUTH` adds nothing, so messages keep the plain
format. The key is derived once per process (scrypt, zeroband/membership/auth.py), never stored.

Why BLAKE3 in keyed mode (a PRF, hence a MAC, like HMAC-SHA256): one pass over the bytes at
~7 GB/s on one core against ~2 GB/s for HMAC-SHA256 with SHA-NI (measured, 50 MB fp16 payload).
The outer step seals and opens every byte of its payload twice per phase, so at 100M parameters
HMAC alone took ~4 passes over the parameters' memory, BLAKE3 ~1 (docs/results/outer_step.md).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from functools import cached_property

import blake3
import torch

from zeroband.membership.auth import TrustError, _frame, derive_key

LABEL = b"zeroband-wire-v2"  # v2: keyed BLAKE3 (v1: HMAC-SHA256)
TAG_BYTES = 32


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
        """The 32-byte BLAKE3 key of the message tags (its own subkey: no other use shares it)."""
        return self.subkey("message-tags")

    def tag(self, context: bytes, fields: tuple[object, ...], payload: torch.Tensor) -> bytes:
        mac = blake3.blake3(_frame(LABEL, context, *(str(f).encode() for f in fields)), key=self.mac_key)
        mac.update(payload.numpy())  # the tensor's bytes, no copy
        return mac.digest()

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
