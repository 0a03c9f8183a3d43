"""Floods of the coordination store's port (issue 23 item 5, the store's half).

The attacker is a real process of its own (tests/flood_store.py) against a real guarded TCPStore:
20,000 connections that send 8 bytes (in waves: this machine's RLIMIT_NOFILE hard limit is 20,000,
so they cannot all be open at once) and 600 that send 1 byte and stall. On f6cb7f4/f96e652 the
guard forwarded any connection that had sent a byte, so the 600 stalled ones filled its 512 slots
and the store: real clients were refused. Now, with the run's secret, no request is read before the
connection answers the store's challenge; without one, before it sends a whole (keyless) answer.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_the_store_decides_on_a_whole_answer_bound_to_its_challenge_and_port():
    from zeroband.store.guard import ADMITTED, MAGIC, OPEN, WRONG, answer, judge

    key, challenge = b"k" * 32, MAGIC + b"c" * 32
    right = answer(key, challenge, 1234)

    def verdict(got: bytes, key_: bytes | None = key, port: int = 1234, challenge_: bytes = challenge) -> bytes | None:
        return judge(challenge_, got, key_, port)

    assert verdict(right[:31]) is None and verdict(right) == ADMITTED and verdict(right + b"requests") == ADMITTED
    assert verdict(right, port=1235) == WRONG and verdict(right, challenge_=MAGIC + b"d" * 32) == WRONG
    assert verdict(right, key_=b"x" * 32) == WRONG and verdict(b"\x00" * 32) == WRONG
    # without a secret: the answer is keyed with b"", so 1 byte (or an HTTP request) is never enough
    plain = OPEN + b"c" * 32
    assert verdict(b"G", key_=None, challenge_=plain) is None
    assert verdict(answer(b"", plain, 1234), key_=None, challenge_=plain) == ADMITTED
    assert verdict(b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n", key_=None, challenge_=plain) == WRONG
