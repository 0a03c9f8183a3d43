"""The store's public port: nothing reaches the c10d TCPStore before it proves it holds the run's secret.

Idle TCP connections to c10d's TCPStore server (libuv) hold up every new client, for longer the
more there are, until they close: a stranger who opens a few hundred can keep a site's client
past its own timeout (docs/results/store.md, from scripts/bench_store.py). The server has no
setting for this, so the real store listens on an ephemeral loopback port and this guard owns the
public one.

With a run secret (`--auth`, the key on stdin; zeroband/store/client.py derives it):

- on accept the guard sends a fresh random challenge (`MAGIC` + 32 bytes); the client must answer
  `answer(key, challenge, port)` (HMAC-SHA256) within `hello_s`. Only then is a connection to the
  store opened: a stranger's connection never reaches it, whatever it sends;
- unanswered connections are bounded (`max_pending`; when full the oldest is closed, with a reset so
  no TIME_WAIT piles up), and so are authenticated ones (`max_clients`; past it a newcomer is told
  "full"). The guard answers one status byte (`ADMITTED`, `WRONG`, `FULL`), so a site with another
  secret prints why it was refused instead of a c10d socket error;
- the c10d client (C++) cannot answer, so a site reaches a remote store through `Forwarder`: a
  loopback listener in a process of its own that answers the challenge, then pipes.

Without a secret (`sites.insecure`): a connection is forwarded only once it has sent the c10d
client's first message (`C10D_HELLO`, validate + magic number), so one that sends 1 byte and stalls
stays in the bounded, evictable pending set. One that sends the right 5 bytes and then stalls
holds a store connection: without a secret the port is only flood-bounded, not authenticated.

One thread, `selectors`; store traffic is small (keys, counters), so a Python hop costs little.
Guard and forwarder each run in a process of their own (`python zeroband/store/guard.py`,
stdlib only, exit when their parent does): some c10d client calls (`list_keys`) hold the GIL while
they block, so a thread in the same process as such a client would wait for it forever.
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
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import cast

log = logging.getLogger(__name__)

HELLO_S = 5.0  # a client must answer the challenge (or, without a secret, speak c10d) within this
MAX_PENDING = 1024  # connections that have not proved anything yet
MAX_CLIENTS = 256  # authenticated connections, each with its own store connection
SEND_TIMEOUT_S = 10.0
ACCEPTS_PER_TURN = 256  # a flood of connects must not starve the established pipes

MAGIC = b"ZBSG1"  # the challenge's first bytes: "this is a zeroband store guard, version 1"
CHALLENGE_BYTES = len(MAGIC) + 32
ANSWER_BYTES = 32
ADMITTED, WRONG, FULL = b"K", b"R", b"F"
LABEL = b"zeroband-store-guard-v1"
C10D_HELLO = b"\x00\xce\xf7\x85\x3c"  # c10d's VALIDATE query and its magic number 0x3c85f7ce


# ---- the handshake (pure) -------------------------------------------------------------------------

def answer(key: bytes, challenge: bytes, port: int) -> bytes:
    """What proves the key for this challenge at the guard on `port`: fresh per connection, so a
    recorded answer is useless, and bound to the port, so one guard's challenge relayed to another
    (a second run's store on the same machine) is not answered for it."""
    return hmac.digest(key, LABEL + b"|" + struct.pack(">H", port) + b"|" + challenge, "sha256")


@dataclass
class Pending:
    """A connection that has not proved anything yet."""

    since: float
    challenge: bytes = b""  # empty without a secret
    got: bytes = b""


def judge(pending: Pending, key: bytes | None, port: int) -> bytes | None:
    """ADMITTED / WRONG once `pending` has sent enough to decide, else None (wait for more)."""
    want = C10D_HELLO if key is None else answer(key, pending.challenge, port)
    if len(pending.got) < len(want):
        return None
    return ADMITTED if hmac.compare_digest(pending.got[:len(want)], want) else WRONG


class Refused(ConnectionError):
    """The guard refused our handshake; the message says why, in one line. `final`: asking again
    cannot help (wrong secret, not a guard); else (the connection was dropped, e.g. evicted during a
    flood) a new connection may succeed."""

    def __init__(self, message: str, final: bool = True) -> None:
        super().__init__(message)
        self.final = final


def handshake(sock: socket.socket, key: bytes, port: int, timeout_s: float) -> None:
    """Answer the guard's challenge on a connected socket; returns once admitted, else Refused."""
    sock.settimeout(timeout_s)
    challenge = _read_exactly(sock, CHALLENGE_BYTES, "sent no challenge", final_on_timeout=True)
    if not challenge.startswith(MAGIC):
        raise Refused("what answered is not a zeroband store guard (no challenge)")
    sock.sendall(answer(key, challenge, port))
    status = _read_exactly(sock, 1, "gave no verdict on our answer", final_on_timeout=False)
    if status == WRONG:
        raise Refused("the store's guard refused our answer: wrong shared secret")
    if status == FULL:
        raise Refused(f"the store's guard has no free slot ({MAX_CLIENTS} authenticated clients)", final=False)
    if status != ADMITTED:
        raise Refused("the store's guard answered with an unknown status")


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


def authenticated(remote: tuple[str, int], key: bytes, timeout_s: float) -> socket.socket:
    """A connection to the guard at `remote`, admitted; retried on a dropped connection (a flood
    evicts unanswered ones oldest-first) until `timeout_s`. Refused (final) or OSError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(0.1, deadline - time.monotonic())
        sock = None
        try:
            sock = socket.create_connection(remote, timeout=left)
            # the whole time left: a guard on a loaded machine may take seconds to send its challenge
            handshake(sock, key, remote[1], left)
            return sock
        except OSError as e:
            if sock is not None:
                sock.close()
            if (isinstance(e, Refused) and e.final) or time.monotonic() + RETRY_S >= deadline:
                raise
            time.sleep(RETRY_S)


def challenges(remote: tuple[str, int], timeout_s: float = 1.0) -> bool | None:
    """What listens at `remote`, from what it answers to `PROBE`: True, a guard that demands the
    secret (its challenge, sent on accept); False, a store that does not (a guard without a secret
    forwards the probe, and the store echoes its ping; a bare c10d server echoes it too) or not a
    store at all (anything else). None while there is no answer: nothing accepts yet, the connection
    was dropped (a flood evicts), or nothing came within `timeout_s`. Only an answer decides: a
    guard on a loaded machine can be silent for seconds, and silence once read as "no secret" sent a
    site's c10d client, unauthenticated, into its own guard (issue 23's CI flake)."""
    nonce = secrets.token_bytes(4)
    if nonce == MAGIC[:4]:  # the one nonce whose echo reads as a challenge's start
        nonce = b"\0" * 4
    try:
        sock = socket.create_connection(remote, timeout=timeout_s)
    except OSError:
        return None
    try:
        sock.settimeout(timeout_s)
        sock.sendall(PROBE + nonce)
        head = _read_exactly(sock, len(nonce), "", final_on_timeout=True)
        if head == nonce:
            return False
        return head + _read_exactly(sock, len(MAGIC) - len(head), "", final_on_timeout=True) == MAGIC
    except OSError:  # Refused included: dropped, reset or silent, so nothing is known yet
        return None
    finally:
        sock.close()


# c10d's first message, then its PING query (13): a c10d server echoes the 4-byte nonce that follows
PROBE = C10D_HELLO + bytes([13])
RETRY_S = 0.1


# ---- the guard ------------------------------------------------------------------------------------

class StoreGuard:
    def __init__(self, host: str, port: int, backend_port: int, key: bytes | None = None,
                 hello_s: float = HELLO_S, max_pending: int = MAX_PENDING, max_clients: int = MAX_CLIENTS) -> None:
        self.backend = ("127.0.0.1", backend_port)
        self.key, self.hello_s, self.max_pending, self.max_clients = key, hello_s, max_pending, max_clients
        self.listener = _listen(host, port)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.pending: OrderedDict[socket.socket, Pending] = OrderedDict()  # oldest first
        self.peer: dict[socket.socket, socket.socket] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="zeroband-store-guard", daemon=True)

    def start(self) -> StoreGuard:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        for s in [*self.pending, *self.peer, self.listener]:
            s.close()

    @property
    def clients(self) -> int:
        return len(self.peer) // 2

    def _loop(self) -> None:
        while not self.stopped.is_set():
            for key, _ in self.sel.select(timeout=0.5):
                sock = cast(socket.socket, key.fileobj)  # only sockets are registered
                try:
                    self._event(sock, key.data)
                except OSError as e:  # one bad connection must not stop the guard
                    log.debug("store guard: %s", e)
                    if key.data != "accept":
                        self._close(sock)
            self._expire(time.monotonic())

    def _event(self, sock: socket.socket, kind: str) -> None:
        if kind == "accept":
            self._accept()
        elif kind == "pending":
            self._hello(sock)
        else:
            self._pipe(sock)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: drop this turn's accepts, never die
                log.warning("store guard: accept: %s", e)
                return
            if len(self.pending) >= self.max_pending:
                self._close(next(iter(self.pending)), reset=True)  # the oldest unproven one makes room
            conn.setblocking(False)
            pending = Pending(time.monotonic())
            if self.key is not None:
                pending.challenge = MAGIC + secrets.token_bytes(CHALLENGE_BYTES - len(MAGIC))
                try:
                    conn.send(pending.challenge)  # 37 bytes into a fresh socket's buffer: never blocks
                except OSError:
                    conn.close()
                    continue
            self.pending[conn] = pending
            self.sel.register(conn, selectors.EVENT_READ, "pending")

    def _hello(self, conn: socket.socket) -> None:
        data = conn.recv(4096)
        if not data:
            self._close(conn, reset=True)
            return
        pending = self.pending[conn]
        pending.got += data
        verdict = judge(pending, self.key, self.port)
        if verdict is None:
            return
        if verdict == ADMITTED and self.clients >= self.max_clients:
            verdict = FULL
        if verdict != ADMITTED:
            if self.key is not None:
                _send_quietly(conn, verdict)
            self._close(conn, reset=self.key is None)
            return
        self._forward(conn, pending)

    def _forward(self, conn: socket.socket, pending: Pending) -> None:
        del self.pending[conn]
        store = socket.create_connection(self.backend, timeout=SEND_TIMEOUT_S)
        for s in (conn, store):
            s.settimeout(SEND_TIMEOUT_S)  # sendall below blocks at most this long on a stuck reader
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer[conn], self.peer[store] = store, conn
        self.sel.modify(conn, selectors.EVENT_READ, "pipe")
        self.sel.register(store, selectors.EVENT_READ, "pipe")
        if self.key is not None:
            conn.sendall(ADMITTED)
            rest = pending.got[ANSWER_BYTES:]  # what the client sent after its answer is store traffic
        else:
            rest = pending.got
        if rest:
            store.sendall(rest)

    def _pipe(self, sock: socket.socket) -> None:
        data = sock.recv(65536)
        if not data:
            self._close(sock)
            return
        self.peer[sock].sendall(data)

    def _expire(self, now: float) -> None:
        while self.pending:
            conn, pending = next(iter(self.pending.items()))
            if now - pending.since < self.hello_s:
                return
            self._close(conn, reset=True)

    def _close(self, sock: socket.socket, reset: bool = False) -> None:
        self.pending.pop(sock, None)
        other = self.peer.pop(sock, None)
        for s in (sock, other):
            if s is None:
                continue
            self.peer.pop(s, None)
            try:
                self.sel.unregister(s)
            except (KeyError, ValueError):
                pass
            if reset:  # an RST instead of a FIN: this side keeps no TIME_WAIT entry per flooded connection
                _reset_on_close(s)
            s.close()


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


# ---- the forwarder (client side) ------------------------------------------------------------------

@dataclass
class Forwarder:
    """A loopback listener for this site's c10d clients: each local connection gets its own
    connection to the remote guard, which it authenticates (`handshake`) before piping bytes."""

    remote: tuple[str, int]
    key: bytes
    timeout_s: float = 10.0
    listener: socket.socket = field(init=False)

    def __post_init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def serve(self) -> None:
        while True:
            local, _ = self.listener.accept()
            threading.Thread(target=self._serve_one, args=(local,), daemon=True).start()

    def _serve_one(self, local: socket.socket) -> None:
        try:
            upstream = authenticated(self.remote, self.key, self.timeout_s)
        except OSError as e:  # Refused included: the c10d client sees a closed connection and retries
            print(f"forwarder: {self.remote[0]}:{self.remote[1]}: {e}", file=sys.stderr, flush=True)
            local.close()
            return
        upstream.settimeout(None)
        for s in (local, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_pump, args=(upstream, local), daemon=True).start()
        _pump(local, upstream)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy until either side ends, then close both (c10d never half-closes)."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


# ---- process plumbing -----------------------------------------------------------------------------

def _listen(host: str, port: int, retry_s: float = 10.0) -> socket.socket:
    """Bind, retrying a few seconds: a run restarted on the same address may find the guard of its
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
    """A helper of a process (its forwarder, its store's guard) ignores the signals that stop it:
    SIGTERM to the helper's whole process group (torchrun's agent, SLURM, a terminal's SIGINT or
    SIGHUP) must not cut the connection its parent still needs for its leave notice; the helper
    ends after its parent instead (the ppid poll, PR_SET_PDEATHSIG), or by SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def _raise_fd_limit() -> None:
    """Room for max_pending + 2 * max_clients descriptors whatever the default soft limit is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_PENDING + 2 * MAX_CLIENTS + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the authenticating guard in front of a c10d TCPStore, or a "
                                                 "site's forwarder to a remote one")
    parser.add_argument("--host", required=True, help="guard: the address to listen on; forwarder: the guard's")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend-port", type=int, help="guard: the store's loopback port")
    parser.add_argument("--forward", action="store_true", help="run a site's forwarder to the guard at host:port")
    parser.add_argument("--auth", action="store_true", help="read the guard key (hex) from stdin: never argv")
    args = parser.parse_args(argv)
    key = bytes.fromhex(sys.stdin.readline().strip()) if args.auth or args.forward else None
    parent = os.getppid()
    outlive_signals()
    if args.forward:
        # no PDEATHSIG: it fires when the *thread* that started us ends, and a forwarder outlives
        # the (heartbeat) thread that may have opened it; the ppid poll below ends it instead
        assert key is not None  # --forward reads its key from stdin above
        fwd = Forwarder((args.host, args.port), key)
        threading.Thread(target=fwd.serve, daemon=True).start()
        print(f"forwarder listening on 127.0.0.1:{fwd.port}", flush=True)
    else:
        die_with_parent(parent)
        _raise_fd_limit()
        guard = StoreGuard(args.host, args.port, args.backend_port, key).start()
        print(f"guard listening on {args.host}:{guard.port}", flush=True)
    while os.getppid() == parent:  # the store dies with its host, and so does its guard
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
