"""The tcp:// coordination store: one process that owns the public port and holds the keys itself.

There is no other port: no inner c10d server behind it and no forwarder in front of a client, so a
connection that has not proved the run's secret reaches nothing, from anywhere (issue 35 item 4).
It also does not inherit c10d's TCPStore server, which idle connections lock up (docs/results/store.md).

With a run secret (`--auth`, the key on stdin; zeroband/store/client.py derives it):

- on accept the store sends a fresh random challenge (`MAGIC` + 32 bytes); the client must answer
  `answer(key, challenge, port)` (HMAC-SHA256) within `hello_s`. Until then nothing it sends is read
  as a request: a stranger's connection never reads, writes or deletes a key, whatever it sends;
- unanswered connections are bounded (`max_pending`; when full the oldest is closed, with a reset so
  no TIME_WAIT piles up), and so are authenticated ones (`max_clients`; past it a newcomer is told
  "full"). The answer is one status byte (`ADMITTED`, `WRONG`, `FULL`), so a site with another
  secret prints why it was refused.

Without a secret (`sites.insecure`) the greeting starts with `OPEN` and the answer is keyed with the
empty key: one that sends a byte and stalls stays in the bounded, evictable pending set, but anyone
who can reach the port can use the store (flood-bounded, not authenticated).

After the handshake: frames (`>I` length, then fields, each `>I` length + bytes), one request then
its reply. Requests: set, get (waits server-side until every key exists or its timeout passes:
`TIMEOUT` + the missing keys), read (the current values, never waits), check, add, cas (c10d
compare_set), mset, del, num, list. Requests of a connection are answered in order, so one waiting
`get` holds back that connection's later requests.

With a secret every frame after the handshake is authenticated too: the client sends a fresh nonce
with its answer, both ends derive `session_key(key, challenge, nonce)`, and each frame carries
`tag(session, direction, n, frame)` (truncated HMAC-SHA256), n counting that direction's frames
from 0 on both ends. Someone on the path, who can see and inject bytes but lacks the key, can then
neither alter, inject, replay, reorder nor drop a request or reply unnoticed: a request that fails
is never applied (the store answers `FORGED`, authentically, and closes the connection), a reply
that fails is an error on the client (`Tampered`), which reconnects with a fresh handshake on its
next call. Cutting the connection stays possible (denial of service, as for any TCP link).

One thread, `selectors`; values are small (keys, counters, addresses). The store runs in a process
of its own (`python zeroband/store/guard.py`, stdlib only, exits when its parent does): some client
calls hold the GIL while they block, and a server thread in such a process would wait for them.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import hmac
import logging
import os
import resource
import secrets
import selectors
import signal
import socket
import struct
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import cast

log = logging.getLogger(__name__)

HELLO_S = 5.0  # a client must answer the challenge within this
MAX_PENDING = 1024  # connections that have not proved anything yet
MAX_CLIENTS = 256  # authenticated connections
MAX_FRAME = 64 << 20  # one request's bytes; a larger one closes its connection
MAX_OUT = 256 << 20  # replies a client has not read; past it its connection is closed
ACCEPTS_PER_TURN = 256  # a flood of connects must not starve the established clients

MAGIC, OPEN = b"ZBSG3", b"ZBSO3"  # a greeting's first bytes: the store demands the secret / does not
CHALLENGE_BYTES = len(MAGIC) + 32
ANSWER_BYTES = 32
NONCE_BYTES = 16  # the client's share of the session key, sent after its answer (with a secret only)
TAG_BYTES = 16  # after every frame, with a secret: a truncated HMAC-SHA256
ADMITTED, WRONG, FULL = b"K", b"R", b"F"
LABEL = b"zeroband-store-guard-v2"
SESSION_LABEL = b"zeroband-store-session-v1"
TO_STORE, TO_CLIENT = b"C", b"S"  # a tag's direction byte: a request's tag never verifies as a reply's
OK, TIMEOUT, ERROR = b"ok", b"timeout", b"error"
FORGED = b"forged"  # the store's last reply on a connection whose request failed authentication


# ---- the handshake (pure) -------------------------------------------------------------------------

def answer(key: bytes, challenge: bytes, port: int) -> bytes:
    """What proves the key for this challenge at the store on `port`: fresh per connection, so a
    recorded answer is useless, and bound to the port, so one store's challenge relayed to another
    (a second run's store on the same machine) is not answered for it. Without a secret `key` is b""."""
    return hmac.digest(key, LABEL + b"|" + struct.pack(">H", port) + b"|" + challenge, "sha256")


def judge(challenge: bytes, got: bytes | bytearray, key: bytes | None, port: int) -> bytes | None:
    """ADMITTED / WRONG once `got` holds a whole answer, else None (wait for more)."""
    if len(got) < ANSWER_BYTES:
        return None
    want = answer(key or b"", challenge, port)
    return ADMITTED if hmac.compare_digest(bytes(got[:ANSWER_BYTES]), want) else WRONG


def session_key(key: bytes, challenge: bytes, nonce: bytes) -> bytes:
    """The key a connection's frames are tagged with. Both ends know it after the handshake, an
    observer does not (it needs `key`). Fresh per connection from both sides: the store's challenge
    (a client cannot replay a recorded session into the store) and the client's nonce (an impostor
    store replaying a recorded challenge cannot replay that session's replies to the client)."""
    return hmac.digest(key, SESSION_LABEL + b"|" + challenge + b"|" + nonce, "sha256")


def tag(session: bytes, direction: bytes, seq: int, frame: bytes) -> bytes:
    """Frame number `seq` of `direction` (TO_STORE, TO_CLIENT) on the connection keyed `session`.
    The number is never sent: both ends count, so a replayed, reordered, dropped or injected frame
    is checked against the wrong number and fails."""
    return hmac.digest(session, direction + struct.pack(">Q", seq) + frame, "sha256")[:TAG_BYTES]


def verify(session: bytes, direction: bytes, seq: int, frame: bytes, got: bytes | bytearray) -> bool:
    return hmac.compare_digest(tag(session, direction, seq, frame), bytes(got))


class Tampered(ConnectionError):
    """A frame of an authenticated store connection failed its tag: someone on the path altered,
    injected, replayed or dropped bytes. The connection is dropped; the next call opens a new one."""


class Refused(ConnectionError):
    """The store refused our handshake; the message says why, in one line. `final`: asking again
    cannot help (wrong secret, no secret, not a store); else (the connection was dropped, e.g.
    evicted during a flood) a new connection may succeed."""

    def __init__(self, message: str, final: bool = True) -> None:
        super().__init__(message)
        self.final = final


NO_SECRET = "the store demands the run's shared secret and this site has none"


def handshake(sock: socket.socket, key: bytes | None, port: int, timeout_s: float) -> bytes | None:
    """Answer the store's challenge on a connected socket; once admitted, the connection's session
    key if the store demands the secret (its frames are tagged), None if not; else Refused."""
    sock.settimeout(timeout_s)
    challenge = _read_exactly(sock, CHALLENGE_BYTES, "sent no challenge", final_on_timeout=True)
    keyed = challenge.startswith(MAGIC)
    if not keyed and not challenge.startswith(OPEN):
        raise Refused("what answered is not a zeroband store (no challenge)")
    if keyed and key is None:
        raise Refused(NO_SECRET)
    nonce = secrets.token_bytes(NONCE_BYTES) if keyed else b""
    sock.sendall(answer(key if keyed and key else b"", challenge, port) + nonce)
    status = _read_exactly(sock, 1, "gave no verdict on our answer", final_on_timeout=False)
    if status == WRONG:
        raise Refused("the store's guard refused our answer: wrong shared secret")
    if status == FULL:
        raise Refused(f"the store has no free slot ({MAX_CLIENTS} authenticated clients)", final=False)
    if status != ADMITTED:
        raise Refused("the store answered with an unknown status")
    return session_key(key, challenge, nonce) if keyed and key else None


def _read_exactly(sock: socket.socket, n: int, failed: str, final_on_timeout: bool) -> bytes:
    data = b""
    try:
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise Refused(f"the store closed the connection and {failed}", final=False)
            data += chunk
    except TimeoutError:
        raise Refused(f"the store {failed} within {sock.gettimeout():.3g} s", final=final_on_timeout) from None
    return data


def authenticated(remote: tuple[str, int], key: bytes | None,
                  timeout_s: float) -> tuple[socket.socket, bytes | None]:
    """A connection to the store at `remote`, admitted, and its session key (None: the store demands
    no secret, its frames are not tagged); retried on a dropped connection (a flood evicts
    unanswered ones oldest-first) and while nothing listens yet, until `timeout_s`. Refused (final)
    or OSError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(0.1, deadline - time.monotonic())
        sock = None
        try:
            sock = socket.create_connection(remote, timeout=left)
            # the whole time left: a store on a loaded machine may take seconds to send its challenge
            session = handshake(sock, key, remote[1], left)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock, session
        except OSError as e:
            if sock is not None:
                sock.close()
            if (isinstance(e, Refused) and e.final) or time.monotonic() + RETRY_S >= deadline:
                raise
            time.sleep(RETRY_S)


RETRY_S = 0.1


# ---- frames (pure) --------------------------------------------------------------------------------

def encode(fields: list[bytes]) -> bytes:
    body = b"".join(struct.pack(">I", len(f)) + f for f in fields)
    return struct.pack(">I", len(body)) + body


def decode(body: bytes | memoryview) -> list[bytes]:
    """A frame's fields; ValueError if they do not add up to the frame."""
    fields, at = [], 0
    while at < len(body):
        if at + 4 > len(body):
            raise ValueError("truncated field length")
        (n,) = struct.unpack_from(">I", body, at)
        if at + 4 + n > len(body):
            raise ValueError("truncated field")
        fields.append(bytes(body[at + 4:at + 4 + n]))
        at += 4 + n
    return fields


def read_frame(sock: socket.socket) -> list[bytes]:
    return decode(read_raw_frame(sock)[4:])


def read_raw_frame(sock: socket.socket) -> bytes:
    """One whole frame as sent (its length, then its fields): what a tag covers."""
    head = recv_exactly(sock, 4)
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ConnectionError(f"the store sent a frame of {n} bytes")
    return head + recv_exactly(sock, n)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionResetError("the store closed the connection")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


# ---- the store ------------------------------------------------------------------------------------

@dataclass(eq=False)
class Conn:
    sock: socket.socket
    since: float
    challenge: bytes = b""
    admitted: bool = False
    got: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)
    waiting: Wait | None = None
    session: bytes | None = None  # with a secret: the key its frames are tagged with
    got_n: int = 0  # requests verified so far: the next one's tag number
    sent_n: int = 0  # replies tagged so far


@dataclass(eq=False)
class Wait:
    """A `get` answered once every key exists, or TIMEOUT at `deadline`."""

    conn: Conn
    keys: list[bytes]
    deadline: float


class KeyStore:
    """The listener, the handshake and the keys (a dict), in one selectors loop."""

    def __init__(self, host: str, port: int, key: bytes | None = None, hello_s: float = HELLO_S,
                 max_pending: int = MAX_PENDING, max_clients: int = MAX_CLIENTS) -> None:
        self.key, self.hello_s, self.max_pending, self.max_clients = key, hello_s, max_pending, max_clients
        self.listener = _listen(host, port)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.pending: OrderedDict[socket.socket, Conn] = OrderedDict()  # oldest first
        self.clients: dict[socket.socket, Conn] = {}
        self.data: dict[bytes, bytes] = {}
        self.watchers: dict[bytes, set[Wait]] = {}  # key -> the waits that miss it
        self.waits: set[Wait] = set()
        self.woken: list[Conn] = []  # connections whose wait ended: serve their next requests

    def serve_forever(self, alive=lambda: True) -> None:
        while alive():
            for key, mask in self.sel.select(timeout=self._select_s()):
                sock = cast(socket.socket, key.fileobj)  # only sockets are registered
                try:
                    if key.data is None:
                        self._accept()
                        continue
                    if mask & selectors.EVENT_WRITE:
                        self._flush(key.data)
                    if mask & selectors.EVENT_READ and sock.fileno() >= 0:
                        self._read(key.data)
                except (OSError, ValueError, IndexError, struct.error) as e:  # one bad connection must not stop the store
                    log.debug("store: %s", e)
                    if key.data is not None:
                        self._close(key.data)
            now = time.monotonic()
            self._expire(now)
            while self.woken:
                conn = self.woken.pop()
                if conn.sock.fileno() >= 0:
                    self._serve(conn)

    def _select_s(self) -> float:
        soonest = min((w.deadline for w in self.waits), default=math_inf)
        return max(0.0, min(0.5, soonest - time.monotonic()))

    # ---- connections ------------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: drop this turn's accepts, never die
                log.warning("store: accept: %s", e)
                return
            if len(self.pending) >= self.max_pending:
                self._close(next(iter(self.pending.values())), reset=True)  # the oldest unproven one makes room
            sock.setblocking(False)
            conn = Conn(sock, time.monotonic())
            conn.challenge = (MAGIC if self.key is not None else OPEN) + secrets.token_bytes(CHALLENGE_BYTES - 5)
            try:
                sock.send(conn.challenge)  # 37 bytes into a fresh socket's buffer: never blocks
            except OSError:
                sock.close()
                continue
            self.pending[sock] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Conn) -> None:
        data = conn.sock.recv(1 << 20)
        if not data:
            self._close(conn, reset=not conn.admitted)
            return
        conn.got += data
        if not conn.admitted:
            if len(conn.got) < ANSWER_BYTES + (NONCE_BYTES if self.key is not None else 0):
                return  # judged once the nonce is in too: a wrong answer's connection ends either way
            verdict = judge(conn.challenge, conn.got, self.key, self.port)
            assert verdict is not None  # a whole answer is in
            if verdict == ADMITTED and len(self.clients) >= self.max_clients:
                verdict = FULL
            if verdict != ADMITTED:  # a FIN after it, not a reset, which could discard the verdict on its way
                _send_quietly(conn.sock, verdict)
                self._close(conn)
                return
            if self.key is not None:
                nonce = bytes(conn.got[ANSWER_BYTES:ANSWER_BYTES + NONCE_BYTES])
                conn.session = session_key(self.key, conn.challenge, nonce)
                del conn.got[:ANSWER_BYTES + NONCE_BYTES]
            else:
                del conn.got[:ANSWER_BYTES]
            del self.pending[conn.sock]
            conn.admitted = True
            self.clients[conn.sock] = conn
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.out += ADMITTED
            self._flush(conn)
        self._serve(conn)

    def _serve(self, conn: Conn) -> None:
        """Answer the complete requests `conn` has sent, in order, until one waits."""
        while conn.waiting is None and len(conn.got) >= 4:
            (n,) = struct.unpack_from(">I", conn.got)
            if n > MAX_FRAME:
                raise ValueError(f"a request of {n} bytes")
            end = 4 + n + (TAG_BYTES if conn.session is not None else 0)
            if len(conn.got) < end:
                return
            frame = bytes(conn.got[:4 + n])
            if conn.session is not None:
                if not verify(conn.session, TO_STORE, conn.got_n, frame, conn.got[4 + n:end]):
                    self._refuse_forged(conn)
                    return
                conn.got_n += 1
            del conn.got[:end]
            reply = self._handle(conn, decode(frame[4:]))
            if reply is not None:
                self._reply(conn, reply)

    def _refuse_forged(self, conn: Conn) -> None:
        """A request that fails its tag is never applied, nor is anything after it on the connection
        (the counts no longer agree): the client is told why, in a reply it can verify, and the
        connection ends. The client's next call opens a new one, with a fresh session key."""
        log.warning("store: a request failed authentication (altered, injected or replayed on the way): "
                    "not applied, connection closed")
        self._reply(conn, [FORGED])
        try:
            conn.sock.shutdown(socket.SHUT_WR)  # the FIN after the reply
        except OSError:
            pass
        self._close(conn)

    def _reply(self, conn: Conn, fields: list[bytes]) -> None:
        frame = encode(fields)
        conn.out += frame
        if conn.session is not None:
            conn.out += tag(conn.session, TO_CLIENT, conn.sent_n, frame)
            conn.sent_n += 1
        self._flush(conn)

    def _flush(self, conn: Conn) -> None:
        """Send what the socket takes now, the rest when it is writable; never raises: it runs for
        one connection while another's request is handled (a set wakes a get)."""
        if conn.sock.fileno() < 0:
            return
        try:
            if conn.out:
                try:
                    del conn.out[:conn.sock.send(conn.out)]
                except BlockingIOError:
                    pass
            if len(conn.out) > MAX_OUT:
                raise ConnectionError("a client that does not read its replies")
            self.sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0), conn)
        except OSError as e:
            log.debug("store: %s", e)
            self._close(conn)

    def _expire(self, now: float) -> None:
        while self.pending:
            conn = next(iter(self.pending.values()))
            if now - conn.since < self.hello_s:
                break
            self._close(conn, reset=True)
        for wait in [w for w in self.waits if w.deadline <= now]:
            self._end_wait(wait)
            self._reply(wait.conn, [TIMEOUT, *(k for k in wait.keys if k not in self.data)])
            self.woken.append(wait.conn)

    def _close(self, conn: Conn, reset: bool = False) -> None:
        self.pending.pop(conn.sock, None)
        self.clients.pop(conn.sock, None)
        if conn.waiting is not None:
            self._end_wait(conn.waiting)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        if reset:  # an RST instead of a FIN: this side keeps no TIME_WAIT entry per flooded connection
            _reset_on_close(conn.sock)
        conn.sock.close()

    # ---- the keys ---------------------------------------------------------------------------------
    def _handle(self, conn: Conn, fields: list[bytes]) -> list[bytes] | None:
        op, args = fields[0], fields[1:]
        if op == b"set":
            self._set(args[0], args[1])
            return [OK]
        if op == b"mset":
            for k, v in zip(args[::2], args[1::2]):
                self._set(k, v)
            return [OK]
        if op == b"get":  # timeout (ms), keys
            keys = args[1:]
            if all(k in self.data for k in keys):
                return [OK, *(self.data[k] for k in keys)]
            wait = Wait(conn, keys, time.monotonic() + int(args[0]) / 1000)
            conn.waiting = wait
            self.waits.add(wait)
            for k in keys:
                if k not in self.data:
                    self.watchers.setdefault(k, set()).add(wait)
            return None
        if op == b"read":  # the current values, never waits: b"=" + value, or b"" where missing
            return [OK, *(b"=" + self.data[k] if k in self.data else b"" for k in args)]
        if op == b"check":
            return [OK, b"1" if all(k in self.data for k in args) else b"0"]
        if op == b"add":
            try:
                value = int(self.data.get(args[0], b"0")) + int(args[1])
            except ValueError:
                return [ERROR, b"add: the key holds a value that is not an integer"]
            self._set(args[0], str(value).encode())
            return [OK, str(value).encode()]
        if op == b"cas":  # c10d's compare_set
            k, expected, desired = args
            now = self.data.get(k)
            if (now is None and not expected) or (now is not None and now == expected):
                self._set(k, desired)
                return [OK, desired]
            return [OK, expected if now is None else now]
        if op == b"del":
            return [OK, b"1" if self.data.pop(args[0], None) is not None else b"0"]
        if op == b"num":
            return [OK, str(len(self.data)).encode()]
        if op == b"list":
            return [OK, *self.data]
        return [ERROR, b"unknown request " + op[:32]]

    def _set(self, key: bytes, value: bytes) -> None:
        self.data[key] = value
        for wait in self.watchers.pop(key, ()):
            if all(k in self.data for k in wait.keys):
                self._end_wait(wait)
                self._reply(wait.conn, [OK, *(self.data[k] for k in wait.keys)])
                self.woken.append(wait.conn)

    def _end_wait(self, wait: Wait) -> None:
        self.waits.discard(wait)
        wait.conn.waiting = None
        for k in wait.keys:
            watching = self.watchers.get(k)
            if watching is not None:
                watching.discard(wait)
                if not watching:
                    del self.watchers[k]


math_inf = float("inf")


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data)
    except OSError:
        pass


def _reset_on_close(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


# ---- process plumbing -----------------------------------------------------------------------------

def _listen(host: str, port: int, retry_s: float = 10.0) -> socket.socket:
    """Bind, retrying a few seconds: a run restarted on the same address may find the store of its
    previous incarnation still closing."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return socket.create_server((host, port), backlog=4096)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """`sig` to this process when its parent dies (Linux PR_SET_PDEATHSIG), so that nothing outlives
    its supervisor: a port is free, a run.lock released the moment it is. It fires when the parent
    *thread* that started this process ends: call it only where that thread lives as long."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # elsewhere a ppid poll does it (main() below: within half a second)
    if os.getppid() != parent:  # the parent died before the prctl
        os.kill(os.getpid(), sig)


def outlive_signals() -> None:
    """The store ignores the signals that stop its host's process group: SIGTERM to the group
    (torchrun's agent, SLURM, a terminal's SIGINT or SIGHUP) must not end the store while its host,
    and the sites it serves, still write their leave notices; it ends after its parent instead
    (PR_SET_PDEATHSIG, the ppid poll), or by SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def _raise_fd_limit() -> None:
    """Room for max_pending + max_clients descriptors whatever the default soft limit is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_PENDING + MAX_CLIENTS + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the tcp:// coordination store")
    parser.add_argument("--host", required=True, help="the address to listen on")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--auth", action="store_true", help="read the key (hex) from stdin: never argv")
    args = parser.parse_args(argv)
    key = bytes.fromhex(sys.stdin.readline().strip()) if args.auth else None
    parent = os.getppid()
    outlive_signals()
    die_with_parent(parent)
    _raise_fd_limit()
    store = KeyStore(args.host, args.port, key)
    print(f"store listening on {args.host}:{store.port}", flush=True)
    store.serve_forever(lambda: os.getppid() == parent)  # the store dies with its host
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
