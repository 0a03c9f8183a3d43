"""Floods of the coordination store's port (issue 23 item 5, the store's half).

The attacker is a real process of its own (tests/flood_store.py) against a real guarded TCPStore:
20,000 connections that send 8 bytes (in waves: this machine's RLIMIT_NOFILE hard limit is 20,000,
so they cannot all be open at once) and 600 that send 1 byte and stall. On f6cb7f4/f96e652 the
guard forwarded any connection that had sent a byte, so the 600 stalled ones filled its 512 slots
and the store: real clients were refused. Now, with the run's secret, nothing reaches the store
before it answers the guard's challenge; without one, before it sends c10d's first message.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_the_guard_decides_on_a_whole_answer_bound_to_its_challenge_and_port():
    from zeroband.store.guard import ADMITTED, C10D_HELLO, MAGIC, WRONG, Pending, answer, judge

    key, challenge = b"k" * 32, MAGIC + b"c" * 32
    right = answer(key, challenge, 1234)

    def verdict(got: bytes, key_=key, port: int = 1234, challenge_: bytes = challenge) -> bytes | None:
        return judge(Pending(0.0, challenge_, got), key_, port)

    assert verdict(right[:31]) is None and verdict(right) == ADMITTED and verdict(right + b"store bytes") == ADMITTED
    assert verdict(right, port=1235) == WRONG and verdict(right, challenge_=MAGIC + b"d" * 32) == WRONG
    assert verdict(right, key_=b"x" * 32) == WRONG and verdict(b"\x00" * 32) == WRONG
    assert verdict(C10D_HELLO[:1], key_=None) is None  # without a secret: 1 byte is not enough to forward
    assert verdict(C10D_HELLO + b"\x0d", key_=None) == ADMITTED and verdict(b"GET /", key_=None) == WRONG
