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
`TIMEOUT` + the missing keys), check, add, cas (c10d compare_set), mset, del, num, list. Requests of a
connection are answered in order, so one waiting `get` holds back that connection's later requests.

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

MAGIC, OPEN = b"ZBSG2", b"ZBSO2"  # a greeting's first bytes: the store demands the secret / does not
CHALLENGE_BYTES = len(MAGIC) + 32
ANSWER_BYTES = 32
ADMITTED, WRONG, FULL = b"K", b"R", b"F"
LABEL = b"zeroband-store-guard-v2"
OK, TIMEOUT, ERROR = b"ok", b"timeout", b"error"


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


class Refused(ConnectionError):
    """The store refused our handshake; the message says why, in one line. `final`: asking again
    cannot help (wrong secret, no secret, not a store); else (the connection was dropped, e.g.
    evicted during a flood) a new connection may succeed."""

    def __init__(self, message: str, final: bool = True) -> None:
        super().__init__(message)
        self.final = final


NO_SECRET = "the store demands the run's shared secret and this site has none"


def handshake(sock: socket.socket, key: bytes | None, port: int, timeout_s: float) -> bool:
    """Answer the store's challenge on a connected socket; whether the store demands the secret,
    once admitted, else Refused."""
    sock.settimeout(timeout_s)
    challenge = _read_exactly(sock, CHALLENGE_BYTES, "sent no challenge", final_on_timeout=True)
    keyed = challenge.startswith(MAGIC)
    if not keyed and not challenge.startswith(OPEN):
        raise Refused("what answered is not a zeroband store (no challenge)")
    if keyed and key is None:
        raise Refused(NO_SECRET)
    sock.sendall(answer(key if keyed and key else b"", challenge, port))
    status = _read_exactly(sock, 1, "gave no verdict on our answer", final_on_timeout=False)
    if status == WRONG:
        raise Refused("the store's guard refused our answer: wrong shared secret")
    if status == FULL:
        raise Refused(f"the store has no free slot ({MAX_CLIENTS} authenticated clients)", final=False)
    if status != ADMITTED:
        raise Refused("the store answered with an unknown status")
    return keyed


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


def authenticated(remote: tuple[str, int], key: bytes | None, timeout_s: float) -> tuple[socket.socket, bool]:
    """A connection to the store at `remote`, admitted, and whether it demanded the secret; retried
    on a dropped connection (a flood evicts unanswered ones oldest-first) and while nothing listens
    yet, until `timeout_s`. Refused (final) or OSError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(0.1, deadline - time.monotonic())
        sock = None
        try:
            sock = socket.create_connection(remote, timeout=left)
            # the whole time left: a store on a loaded machine may take seconds to send its challenge
            keyed = handshake(sock, key, remote[1], left)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock, keyed
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
    head = _recv_exactly(sock, 4)
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ConnectionError(f"the store sent a frame of {n} bytes")
    return decode(_recv_exactly(sock, n))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
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
            verdict = judge(conn.challenge, conn.got, self.key, self.port)
            if verdict is None:
                return
            if verdict == ADMITTED and len(self.clients) >= self.max_clients:
                verdict = FULL
            if verdict != ADMITTED:  # a FIN after it, not a reset, which could discard the verdict on its way
                _send_quietly(conn.sock, verdict)
                self._close(conn)
                return
            del self.pending[conn.sock], conn.got[:ANSWER_BYTES]
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
            if len(conn.got) < 4 + n:
                return
            fields = decode(bytes(conn.got[4:4 + n]))
            del conn.got[:4 + n]
            reply = self._handle(conn, fields)
            if reply is not None:
                self._reply(conn, reply)

    def _reply(self, conn: Conn, fields: list[bytes]) -> None:
        conn.out += encode(fields)
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
