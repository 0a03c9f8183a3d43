"""Every frame of a tcp:// store connection with a secret is authenticated (store/guard.py): bytes
altered, injected or replayed by someone on the path are never applied by the store and are a
clear error on the client, whose next call reconnects.

The relay below sits between a real client and a real store process and forwards the handshake
untouched (so the attacker is on an authenticated connection), then frame by frame, letting a test
change what the first connection carries. The store answers challenges bound to its own port, so
the relay listens on 127.0.0.2 with the store's port number.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.multiproc import free_port
from zeroband.store.client import KeyStoreClient, host_tcp_store
from zeroband.store.guard import (
    ANSWER_BYTES,
    CHALLENGE_BYTES,
    NONCE_BYTES,
    OK,
    TAG_BYTES,
    TO_CLIENT,
    TO_STORE,
    encode,
    read_raw_frame,
    recv_exactly,
    session_key,
    tag,
    verify,
)

SECRET = b"frames-test-shared-secret-0123456789"
Hook = Callable[[int, bytes, list[bytes]], bytes]  # (frame number, frame + tag, earlier ones) -> what to forward


# ---- the pure functions ---------------------------------------------------------------------------

def test_a_tag_binds_the_session_the_direction_the_number_and_the_bytes():
    session = session_key(b"k" * 32, b"c" * CHALLENGE_BYTES, b"n" * NONCE_BYTES)
    frame = encode([b"set", b"key", b"value"])
    t = tag(session, TO_STORE, 3, frame)
    assert len(t) == TAG_BYTES and t == tag(session, TO_STORE, 3, frame)
    assert verify(session, TO_STORE, 3, frame, t)
    assert not verify(session, TO_CLIENT, 3, frame, t)  # a request's tag is no reply's
    assert not verify(session, TO_STORE, 2, frame, t) and not verify(session, TO_STORE, 4, frame, t)  # replayed, reordered
    altered = bytearray(frame)
    altered[-1] ^= 1
    assert not verify(session, TO_STORE, 3, bytes(altered), t)
    assert not verify(session, TO_STORE, 3, frame, t[:-1] + bytes([t[-1] ^ 1]))
    assert not verify(session, TO_STORE, 3, frame, t[:8])  # a short tag
    other = session_key(b"k" * 32, b"c" * CHALLENGE_BYTES, b"m" * NONCE_BYTES)
    assert not verify(other, TO_STORE, 3, frame, t)


def test_a_session_key_is_fresh_per_challenge_and_nonce_and_needs_the_key():
    keys = {session_key(k, c, n) for k in (b"a" * 32, b"b" * 32) for c in (b"1" * 37, b"2" * 37)
            for n in (b"x" * 16, b"y" * 16)}
    assert len(keys) == 8


# ---- a real store, through a tampering relay -------------------------------------------------------

class TamperRelay:
    """Forwards 127.0.0.2:port to the store on 127.0.0.1:port: the handshake as is, then whole frames
    (length, fields, tag); `up` (client -> store) and `down` (store -> client) rewrite the first
    connection's frames. Later connections (the client's reconnect) pass untouched."""

    def __init__(self, port: int, up: Hook | None = None, down: Hook | None = None) -> None:
        self.port, self.up, self.down = port, up, down
        self.listener = socket.create_server(("127.0.0.2", port))
        self.connections = 0
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            store = socket.create_connection(("127.0.0.1", self.port))
            first = self.connections == 0
            self.connections += 1
            self.socks += [client, store]
            for src, dst, handshake, hook in ((client, store, ANSWER_BYTES + NONCE_BYTES, self.up),
                                               (store, client, CHALLENGE_BYTES + 1, self.down)):
                threading.Thread(target=self._pump, args=(src, dst, handshake, hook if first else None),
                                 daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, handshake: int, hook: Hook | None) -> None:
        try:
            while handshake:  # as it comes: the challenge before the verdict
                chunk = src.recv(handshake)
                if not chunk:
                    return
                dst.sendall(chunk)
                handshake -= len(chunk)
            seen: list[bytes] = []
            while True:
                frame = read_raw_frame(src) + recv_exactly(src, TAG_BYTES)
                dst.sendall(hook(len(seen), frame, seen) if hook else frame)
                seen.append(frame)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept: a plain close leaves the port bound
        except OSError:
            pass
        self.listener.close()
        for s in self.socks:
            s.close()


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[KeyStoreClient, int]]:
    port = free_port()
    host = host_tcp_store("127.0.0.1", port, timedelta(seconds=30), SECRET)
    yield host, port
    del host


def _flip(frame: bytes, at: int) -> bytes:
    b = bytearray(frame)
    b[at] ^= 0x01
    return bytes(b)


def _on(n: int, change: Callable[[bytes, list[bytes]], bytes]) -> Hook:
    """A hook that changes frame number `n` only."""
    return lambda i, frame, seen: change(frame, seen) if i == n else frame


FORGED_REQUEST = "refused a request of ours that failed authentication"
FORGED_REPLY = "a reply on the store connection failed authentication"
ATTACKS = {  # name: (up hook, down hook, the error the client raises); frame 0 is a get, 1 an add, 2 the target
    # the value of `set k new` turned into another, on the way to the store
    "flip a request byte": (_on(2, lambda f, _: _flip(f, -TAG_BYTES - 1)), None, FORGED_REQUEST),
    # an attacker's own `del k` (it cannot compute a tag) slipped in before the client's request
    "inject a delete": (_on(2, lambda f, _: encode([b"del", b"k"]) + bytes(TAG_BYTES) + f), None, FORGED_REQUEST),
    # the client's earlier `add n 1`, with its genuine tag, sent again
    "replay a request": (_on(2, lambda f, seen: seen[1] + f), None, FORGED_REQUEST),
    # the client's `set` dropped: only a stall, until the client's timeout
    "drop a request": (_on(2, lambda f, _: b""), None, "timed out"),
    # the store's reply altered on the way back
    "flip a reply byte": (None, _on(2, lambda f, _: _flip(f, -TAG_BYTES - 1)), FORGED_REPLY),
    # a forged `check` answer "1" (with a made-up tag)
    "forge a reply": (None, _on(2, lambda f, _: encode([OK, b"1"]) + bytes(TAG_BYTES)), FORGED_REPLY),
    # the store's earlier reply (the `add` counter) replayed in place of this one
    "replay a reply": (None, _on(2, lambda f, seen: seen[1]), FORGED_REPLY),
}


def _guard_key() -> bytes:
    from zeroband.store.client import guard_key
    from zeroband.trust.secret import as_secret

    return guard_key(as_secret(SECRET))


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_frames_altered_injected_or_replayed_are_never_applied_and_the_client_says_so(store, attack):
    host, port = store
    up, down, error = ATTACKS[attack]
    host.set("k", "old")
    host.delete_key("n")
    relay = TamperRelay(port, up, down)
    try:
        client = KeyStoreClient("127.0.0.2", port, timedelta(seconds=3), _guard_key())
        assert client.get("k") == b"old"  # frame 0
        assert client.add("n", 1) == 1  # frame 1
        with pytest.raises(dist.DistNetworkError, match=error) as failed:
            if down is None:
                client.set("k", "new")  # frame 2, tampered on the way to the store
            else:
                client.check(["missing"])  # frame 2's reply tampered on the way back
        assert f"store tcp://127.0.0.2:{port}" in str(failed.value)
        # nothing forged was applied: the value, the key's presence and the counter are the client's
        assert host.get("k") == b"old" and host.get("n") == b"1"
        # the next call reconnects (a fresh handshake and session key) and works
        client.set("after", attack)
        assert host.get("after") == attack.encode() and client.read_many(["k", "n"]) == [b"old", b"1"]
        assert relay.connections == 2
    finally:
        relay.close()


def test_a_request_injected_into_an_idle_connection_is_refused_and_its_client_told(store):
    """The attacker injects while the client is not calling: the store applies nothing, and the
    client learns it, from a reply it can verify, on its next call."""
    host, port = store
    host.set("idle", "kept")
    relay = TamperRelay(port)
    try:
        client = KeyStoreClient("127.0.0.2", port, timedelta(seconds=3), _guard_key())
        assert client.get("idle") == b"kept"
        relay.socks[1].sendall(encode([b"del", b"idle"]) + bytes(TAG_BYTES))  # straight to the store
        time.sleep(0.5)
        assert host.get("idle") == b"kept"
        with pytest.raises(dist.DistNetworkError, match=FORGED_REQUEST):
            client.set("idle", "changed")
        assert host.get("idle") == b"kept"
        assert client.read_many(["idle"]) == [b"kept"]
    finally:
        relay.close()
