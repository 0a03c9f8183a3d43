"""The cross-site transport: TLS 1.3 connections that zeroband owns, in place of gloo's.

Why not gloo: its listener keeps an fd and a pair per connection that sends 8 bytes, and aborts
the process when the fds run out (`accept: Too many open files`, SIGABRT: 20,000 connections in
2.6 s killed a site, issue 23 item 5). Nothing in gloo bounds what a stranger may open, so the
cross-site groups run on this module instead (stdlib sockets and threads).

Setup (once per group, i.e. per incarnation or elastic generation; `Transport.connect`):
- every member listens on the configured address (`listen_host`) with an ephemeral port, published
  through the store (signed with the secret, comm/group.py);
- for each pair, the higher rank dials the lower one once per stream, every stream of every peer at
  once (`_dial_all`): its hello announces how many it dials, the streams "auto" kept when this
  process last probed that link, else `streams` (16 for "auto");
- each connection runs TLS 1.3 with mutual authentication under the group's certificate
  (trust/tls.py: derived from the secret's `transport` subkey bound to the group's prefix: run,
  incarnation, generation, shard), pinned on both ends; then, inside it, the dialer sends HELLO
  (src, dst, stream, streams) and the acceptor, once it checked it, answers ADMIT (its rank) as it
  takes the connection. The dialer returns only once ADMIT arrived: a connection the acceptor
  dropped, for whatever reason, is dialed again (`Transport._dial`) instead of being waited for in
  vain. Without a secret (sites.insecure) the same HELLO and ADMIT go in plain TCP: unauthenticated
  and unencrypted, with the same bounds.

Bounds on what a stranger can cost (`_Acceptor`): one selector thread accepts without blocking and
hands at most HANDSHAKE_READ bytes per read to the TLS engine of a connection that has not
authenticated (no thread, no buffer of its own); it closes one that has not finished its handshake
and hello within HELLO_DEADLINE_S and one that fails a check. A connection that completed both is
admitted at once: it leaves the unproven pool, so no stranger's connection ever evicts it.
Unproven ones are bounded: MAX_PENDING_PER_SOURCE per source address and MAX_PENDING in all; a new
one evicts an unproven one of its own source when that source is at its cap, else, when the pool
is full, of the source holding the most (`to_evict`); of a source, the oldest that never sent a
byte goes first, so a peer in the middle of its handshake outlives a flood of empty connections. A flood from one host thus only evicts its own connections,
whatever its rate against the round trip a real peer needs (issue 35 item 2: before, the oldest of
all gave way, so 64 empty connections per round trip kept a real peer out). No thread per
connection, no buffer beyond the fixed sizes. When connecting fails after this listener refused
many connections, the error names that flood (counts, main sources), not only the missing sites.

After setup every message is framed as (tag, total bytes) + payload; the receiver refuses a total
larger than the buffer it posted (no allocation sized by the peer). Matching is gloo's: FIFO per
(peer, tag). With `streams` > 1 a message is cut into contiguous slices (`slices`), slice k sent
on stream k and written into the receiver's buffer at its offset: the same bytes arrive, so the
results are bitwise those of one stream. TLS encrypts and authenticates every byte, in order, per
connection: nothing can be read, altered, replayed, reordered or moved to another stream or pair.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import logging
import os
import queue
import selectors
import socket
import ssl
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from zeroband.comm.link import (
    AUTO,
    LinkProbe,
    ProbeError,
    choose_streams,
    dial_streams,
    probe,
    still_measured,
)
from zeroband.trust.tls import GroupTLS, group_tls
from zeroband.watchdog import PeerTimeout, TransportError, TransportTimeout

log = logging.getLogger(__name__)

LABEL = b"zeroband-transport-v1"
MAGIC = b"ZBT3"  # 3: over TLS 1.3; the hello and the admission are records of the TLS session
HELLO = struct.Struct("!4sIIII")  # magic, src, dst, stream, streams: 20 bytes
ADMIT = struct.Struct("!4sI")  # magic, the acceptor's rank
HEADER = struct.Struct("!QQ")  # message tag, total bytes of the message
HELLO_DEADLINE_S = 3.0  # an unauthenticated connection's whole handshake
MAX_PENDING = 64  # unproven connections (TLS handshake and hello not done yet) held at once
MAX_PENDING_PER_SOURCE = 16  # of which from one source address
REFUSED_SOURCES = 256  # source addresses counted apart in the refusals (the rest: "others")
FLOOD_REFUSED = MAX_PENDING  # refusals that make a connect error name the flood
BACKLOG = 128  # the kernel's queue of connections not yet accepted
MIN_SLICE = 1 << 16  # smaller messages use fewer streams
TLS_CHUNK = 1 << 18  # plaintext bytes encrypted per lock hold; also the raw bytes read per receive
HANDSHAKE_READ = 1 << 14  # raw bytes an unproven connection may hand the TLS engine per read
TLS_HANDSHAKE = 0x16  # the first byte of a TLS handshake record (a ClientHello's)
BROADCAST_TAG, ALLREDUCE_TAG = 1 << 40, (1 << 40) + 1  # above every tag of comm/group.py
PROBE_LIMIT_S = 30.0  # a probe's step may block this long, plus twice sites.probe_s (the transfer's tail)
JOIN_S = 5.0  # how long closing waits for each of a peer's threads (woken by the shutdown, they end at once)
MAX_DIAL_STREAMS = 64  # streams a dialer may announce (sites.streams' upper bound)
DIALS_AHEAD = MAX_PENDING_PER_SOURCE  # handshakes in flight per peer: a dialer fits its address's pending cap


# ----------------------------------------------------------------------------------- pure helpers
def group_key(subkey: bytes, prefix: str) -> bytes:
    """The TLS key of one group: the secret's transport subkey bound to the group's prefix."""
    return hmac.digest(subkey, LABEL + b"|" + prefix.encode(), "sha256")


def make_hello(src: int, dst: int, stream: int, streams: int) -> bytes:
    return HELLO.pack(MAGIC, src, dst, stream, streams)


def check_hello(data: bytes, me: int, size: int) -> tuple[int, int, int] | None:
    """(source rank, stream, streams it dials) of a well-formed hello to `me`, else None. Each
    dialer announces its own number of streams: a link probed before dials those it kept."""
    magic, src, dst, stream, streams = HELLO.unpack(data)
    ok = magic == MAGIC and dst == me and me < src < size and stream < streams <= MAX_DIAL_STREAMS
    return (src, stream, streams) if ok else None


def slices(total: int, streams: int) -> list[tuple[int, int]]:
    """(offset, length) of slice k of a `total`-byte message, for each of `streams` streams: contiguous,
    in order, covering it exactly (trailing streams get empty slices when the message is small)."""
    used = max(1, min(streams, total // MIN_SLICE))
    step = -(-total // used)
    bounds = [min(total, k * step) for k in range(streams + 1)]
    return [(bounds[k], bounds[k + 1] - bounds[k]) for k in range(streams)]


HOST_ENV = "ZEROBAND_TRANSPORT_HOST"


def listen_host() -> str:
    """The address cross-site groups listen on: ZEROBAND_TRANSPORT_HOST (an address of this host);
    else the interface named by GLOO_SOCKET_IFNAME (the setting launchers and the WAN emulator
    already give); else the host name's address, as gloo did. Setting the first lets the
    intra-site gloo group (GLOO_SOCKET_IFNAME) stay on loopback or the site's own network."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if not name:
        return socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = struct.pack("256s", name.encode()[:15])
        try:
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24])  # SIOCGIFADDR
        except OSError as e:
            raise ValueError(f"GLOO_SOCKET_IFNAME={name!r}: no IPv4 address on that interface ({e})") from None


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in place."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("the cross-site transport sends contiguous CPU tensors only")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stub: an ndarray is a buffer


# ----------------------------------------------------------------------------------------- works
class Work:
    """Done when `parts` parts completed; `wait` raises the first error, or TransportTimeout."""

    def __init__(self, parts: int, timeout_s: float, what: str) -> None:
        self.left, self.timeout_s, self.what = parts, timeout_s, what
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.lock = threading.Lock()
        if parts == 0:
            self.done.set()

    def part_done(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left <= 0:
                self.done.set()

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if not self.done.is_set():  # a completed work stays completed
                self.error = error
                self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        limit = self.timeout_s if timeout is None else getattr(timeout, "total_seconds", lambda: timeout)()
        if not self.done.wait(limit):
            raise TransportTimeout(f"{self.what}: nothing for {limit:g} s")
        if self.error is not None:
            raise self.error
        return True


class Then:
    """A work that, once `works` completed, runs `finish` (a collective's local step)."""

    def __init__(self, works: list[Work], finish: Callable[[], None] = lambda: None) -> None:
        self.works, self.finish, self.finished = works, finish, False

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait(timeout)
        if not self.finished:
            self.finished = True
            self.finish()
        return True


# ------------------------------------------------------------------------------- the listener
def to_evict(unproven: dict[str, int], source: str) -> str | None:
    """The source address whose oldest unproven connection gives way so that a new one from `source`
    can be held (None: there is room). `unproven` counts them per source. A source at its own cap
    gives way itself; when the pool is full, the source holding the most does (ties: the newcomer's
    own, then the first listed). A flood from one address therefore only ever evicts its own."""
    if unproven.get(source, 0) >= MAX_PENDING_PER_SOURCE:
        return source
    if sum(unproven.values()) < MAX_PENDING or not unproven:
        return None
    return max(unproven, key=lambda s: (unproven[s], s == source))


class TLSChannel:
    """One transport connection under TLS 1.3: the socket carries the records, an `ssl.SSLObject` over
    memory BIOs does the crypto. OpenSSL's SSL object must not be used by two threads at once, and
    each stream has a sender and a receiver thread: the crypto runs under `lock`, the blocking socket
    calls outside it. Quacks like the socket for everything the transport and the probe use."""

    def __init__(self, sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO) -> None:
        self.sock, self.tls, self.incoming, self.outgoing = sock, tls, incoming, outgoing
        self.lock = threading.Lock()
        self.raw = bytearray(TLS_CHUNK)  # only the one receiving thread reads into it

    def sendall(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), TLS_CHUNK):
            with self.lock:
                self.tls.write(view[start : start + TLS_CHUNK])
                records = self.outgoing.read()
            self.sock.sendall(records)

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        """Up to `nbytes` (or len(view)) decrypted bytes into `view`; 0 once the peer closed."""
        n = min(nbytes or len(view), len(view))
        while True:
            with self.lock:
                try:
                    return cast(int, self.tls.read(n, view))  # with a buffer: the count read
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return 0
            got = self.sock.recv_into(self.raw)
            if got == 0:
                return 0
            with self.lock:
                self.incoming.write(memoryview(self.raw)[:got])

    def __getattr__(self, name: str) -> Any:  # settimeout, setsockopt, shutdown, close: the socket's
        return getattr(self.sock, name)


Conn = socket.socket | TLSChannel  # a connection of the transport: TLS, or plain under sites.insecure


class _Pending:
    """An accepted connection that has not authenticated: its TLS engine (made at its first byte, if
    that starts a TLS handshake record; always None under sites.insecure) and the bytes of its hello
    read so far (fixed size only)."""

    def __init__(self, deadline: float, source: str, secure: bool) -> None:
        self.deadline, self.source, self.data, self.spoke = deadline, source, b"", False
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls: ssl.SSLObject | None = None
        self.shaken = not secure  # the TLS handshake completed (the peer proved the secret)


class _Acceptor:
    """Accepts and authenticates connections on one thread (a selector); hands each authenticated
    one to `admit(src, stream, conn)`. See the module docstring for the bounds it keeps."""

    def __init__(self, host: str, tls: GroupTLS | None, me: int, size: int,
                 admit: Callable[[int, int, int, Conn], None]) -> None:
        self.tls, self.me, self.size, self.admit = tls, me, size, admit
        self.sock = socket.create_server((host, 0), backlog=BACKLOG)
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]
        self.pending: OrderedDict[socket.socket, _Pending] = OrderedDict()  # all of them, oldest first
        self.unproven: dict[str, OrderedDict[socket.socket, None]] = {}  # per source address, oldest first
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.closed = False
        self.refused = 0  # connections closed unauthenticated (for tests and the connect error)
        self.refused_from: dict[str, int] = {}  # of which per source address (REFUSED_SOURCES at most)
        self.lock = threading.Lock()  # `refused_from` is read by the connecting thread
        self.thread = threading.Thread(target=self._loop, name="zeroband-transport-accept", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.closed:
            try:
                events = self.selector.select(0.25)
            except (OSError, ValueError):  # closed under us
                return
            for key, _ in events:
                if key.fileobj is self.sock:
                    self._accept_all()
                elif key.fileobj in self.pending:
                    self._read(cast(socket.socket, key.fileobj))  # only sockets are registered
            self._expire(time.monotonic())

    def _accept_all(self) -> None:
        """Every connection the kernel queued, without blocking; when its source or the pool is full
        an unproven one makes room (`to_evict`: fds stay bounded whatever a stranger opens)."""
        for _ in range(1024):  # then let the pending ones speak
            try:
                conn, peer = self.sock.accept()
            except BlockingIOError:
                return
            except OSError:  # EMFILE and the like: free a slot, try again on the next wakeup
                counts = self._counts()
                self._evict(max(counts, key=counts.__getitem__, default=None))
                return
            source = peer[0]
            self._evict(to_evict(self._counts(), source))
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no flight of the handshake waits for an ACK
            self.pending[conn] = _Pending(time.monotonic() + HELLO_DEADLINE_S, source, self.tls is not None)
            self.unproven.setdefault(source, OrderedDict())[conn] = None
            self.selector.register(conn, selectors.EVENT_READ)

    def _counts(self) -> dict[str, int]:
        return {source: len(conns) for source, conns in self.unproven.items()}

    def _evict(self, source: str | None) -> None:
        """The oldest of `source`'s connections that never sent a byte, else its oldest: a peer in
        the middle of its TLS handshake outlives the empty connections of a flood from its host."""
        if source is not None:
            conns = self.unproven[source]
            self._close(next((c for c in conns if not self.pending[c].spoke), next(iter(conns))))

    def _read(self, conn: socket.socket) -> None:
        """What `conn` sent: TLS records for its handshake, then its hello; a complete valid hello is
        answered with ADMIT and the connection handed over. Any failure closes it."""
        p = self.pending[conn]
        try:
            chunk = conn.recv(HELLO.size - len(p.data) if self.tls is None else HANDSHAKE_READ)
            if not chunk:
                return self._close(conn)
            p.spoke = True
            if self.tls is None:
                p.data += chunk
            else:
                if p.tls is None:  # its first bytes: no engine is made for what is no TLS handshake
                    if chunk[0] != TLS_HANDSHAKE:
                        return self._close(conn)
                    p.tls = self.tls.server.wrap_bio(p.incoming, p.outgoing, server_side=True)
                p.incoming.write(chunk)
                if not p.shaken:
                    try:
                        p.tls.do_handshake()
                        p.shaken = p.tls.getpeercert(binary_form=True) == self.tls.cert
                        if not p.shaken:
                            return self._close(conn)
                    except ssl.SSLWantReadError:
                        pass
                    self._flush(conn, p)
                while p.shaken and len(p.data) < HELLO.size:
                    p.data += p.tls.read(HELLO.size - len(p.data))
        except ssl.SSLWantReadError:
            return None
        except BlockingIOError:
            return None
        except ssl.SSLError:  # another secret, not TLS, a broken record: the alert goes out if it fits
            with contextlib.suppress(OSError):
                conn.send(p.outgoing.read())
            return self._close(conn)
        except OSError:
            return self._close(conn)
        if len(p.data) == HELLO.size:
            self._hello(conn, p)
        return None

    def _flush(self, conn: socket.socket, p: _Pending) -> None:
        """The TLS engine's output, sent without blocking: a handshake flight (~1 kB) or ADMIT fits
        the fresh socket's buffer, so a partial send means a peer that does not read: refused."""
        data = p.outgoing.read()
        if data and conn.send(data) != len(data):
            raise OSError("the peer does not read its handshake")

    def _hello(self, conn: socket.socket, p: _Pending) -> None:
        """A complete hello: admit the connection to its (src, stream) slot, or close it."""
        who = check_hello(p.data, self.me, self.size)
        if who is None:
            return self._close(conn)
        admit = ADMIT.pack(MAGIC, self.me)
        try:
            if p.tls is None:
                conn.send(admit)  # 8 bytes: fits a fresh socket
            else:
                p.tls.write(admit)
                self._flush(conn, p)
        except OSError:
            return self._close(conn)
        self.selector.unregister(conn)
        del self.pending[conn]
        self._forget(p.source, conn)
        conn.setblocking(True)
        self.admit(*who, conn if p.tls is None else TLSChannel(conn, p.tls, p.incoming, p.outgoing))
        return None

    def _forget(self, source: str, conn: socket.socket) -> None:
        del self.unproven[source][conn]
        if not self.unproven[source]:
            del self.unproven[source]

    def _expire(self, now: float) -> None:
        while self.pending:
            conn, p = next(iter(self.pending.items()))
            if p.deadline > now:
                return
            self._close(conn)

    def _close(self, conn: socket.socket) -> None:
        p = self.pending.pop(conn, None)
        if p is not None:
            self._count_refusal(p.source)
            self._forget(p.source, conn)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _count_refusal(self, source: str) -> None:
        self.refused += 1
        if source not in self.refused_from and len(self.refused_from) >= REFUSED_SOURCES:
            source = "others"
        with self.lock:
            self.refused_from[source] = self.refused_from.get(source, 0) + 1

    def refusals(self) -> str:
        """The connections refused so far and their main sources, for an error line."""
        with self.lock:
            top = sorted(self.refused_from.items(), key=lambda item: -item[1])[:3]
        return f"{self.refused:,} connections that did not authenticate (from " + ", ".join(
            f"{source}: {count:,}" for source, count in top) + ")"

    def close(self) -> None:
        self.closed = True
        if threading.current_thread() is not self.thread:  # a finalizer may run on any thread
            self.thread.join(JOIN_S)
        for conn in list(self.pending):
            self._close(conn)
        self.selector.close()
        self.sock.close()


def dial(address: tuple[str, int], tls: GroupTLS | None, me: int, dst: int, stream: int, streams: int,
         admit_s: float = HELLO_DEADLINE_S, rtts: list[float] | None = None) -> Conn:
    """One authenticated connection to `dst` (the dialer's side), returned once the acceptor said it
    admitted it; raises OSError (ssl.SSLError included) or TransportError when it fails
    (`Transport._dial` then dials again). The TLS handshake and the hello wait HELLO_DEADLINE_S at
    most, ADMIT `admit_s`: an acceptor that drops a connection closes it, which ends the wait at
    once, so a longer wait only spares a connection the acceptor took but answered late.
    `rtts` gets the TCP connect's seconds: one round trip (SYN, SYN-ACK), which tells whether an
    earlier probe of the link still holds (comm/link.py `still_measured`)."""
    t0 = time.perf_counter()
    sock = socket.create_connection(address, timeout=HELLO_DEADLINE_S)
    if rtts is not None:
        rtts.append(time.perf_counter() - t0)
    # the handshake's last flight and the hello are two small writes: Nagle would hold the second
    # for the first one's ACK, a round trip more per connection
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        conn: Conn = sock
        if tls is not None:
            conn = _client_handshake(sock, tls, dst)
        conn.sendall(make_hello(me, dst, stream, streams))
        conn.settimeout(max(admit_s, HELLO_DEADLINE_S))
        if _read_exact(conn, ADMIT.size) != ADMIT.pack(MAGIC, dst):
            raise TransportError(f"site {dst} answered the hello with something else than its admission")
        conn.settimeout(None)
        return conn
    except BaseException:
        sock.close()
        raise


def _client_handshake(sock: socket.socket, tls: GroupTLS, dst: int) -> TLSChannel:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    engine = tls.client.wrap_bio(incoming, outgoing, server_side=False)
    while True:
        try:
            engine.do_handshake()
            break
        except ssl.SSLWantReadError:
            if data := outgoing.read():
                sock.sendall(data)
            if not (data := sock.recv(HANDSHAKE_READ)):
                raise TransportError("closed by the peer") from None
            incoming.write(data)
    sock.sendall(outgoing.read())
    if engine.getpeercert(binary_form=True) != tls.cert:
        raise TransportError(f"site {dst} presented another certificate than the group's")
    return TLSChannel(sock, engine, incoming, outgoing)


def _read_exact(sock: Conn, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: Conn, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransportError("closed by the peer")
        got += n


# ------------------------------------------------------------------------------ one peer's links
class _Recv:
    """A posted receive: the buffer, the message size once its first slice announced it, and its work."""

    def __init__(self, view: memoryview, work: Work) -> None:
        self.view, self.work, self.total, self.claims = view, work, -1, 0


class _Peer:
    """The `streams` authenticated connections to one peer: a sender and a receiver thread per
    connection, receives matched FIFO per tag (each stream carries slice k of every message, in
    send order, so the n-th header of a tag on any stream belongs to the n-th message of that tag)."""

    def __init__(self, rank: int, socks: list[Conn]) -> None:
        self.rank, self.socks, self.streams = rank, socks, len(socks)
        self.outbox: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in socks]
        self.posted: dict[int, dict[int, _Recv]] = {}  # tag -> sequence number -> receive
        self.count: dict[int, int] = {}  # receives posted per tag
        self.seen = [dict[int, int]() for _ in socks]  # headers read per tag, per stream
        self.cond = threading.Condition()
        self.error: TransportError | None = None
        self.threads: list[threading.Thread] = []  # joined by `close`: none outlives the group
        for k, sock in enumerate(socks):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for fn, name in ((self._send_loop, "send"), (self._recv_loop, "recv")):
                self.threads.append(threading.Thread(target=fn, args=(k,), name=f"zeroband-transport-{name}-{rank}.{k}",
                                                     daemon=True))
                self.threads[-1].start()

    def send(self, tag: int, view: memoryview, work: Work) -> None:
        for k, (offset, length) in enumerate(slices(len(view), self.streams)):
            self.outbox[k].put((tag, len(view), view[offset : offset + length], work))
        if self.error is not None:  # a sender that already failed may never take them
            work.fail(self.error)

    def recv(self, tag: int, view: memoryview, work: Work) -> None:
        with self.cond:
            if self.error is not None:
                return work.fail(self.error)
            seq = self.count.get(tag, 0)
            self.count[tag] = seq + 1
            self.posted.setdefault(tag, {})[seq] = _Recv(view, work)
            self.cond.notify_all()

    def _send_loop(self, k: int) -> None:
        sock = self.socks[k]
        while True:
            item = self.outbox[k].get()
            if item is None:
                return
            tag, total, view, work = item
            try:
                sock.sendall(HEADER.pack(tag, total))
                if len(view):
                    sock.sendall(view)
                work.part_done()
            except OSError as e:
                self.fail(TransportError(f"connection to site {self.rank}: {e}"))
                work.fail(self.error)

    def _recv_loop(self, k: int) -> None:
        sock, header, r = self.socks[k], bytearray(HEADER.size), None
        try:
            while True:
                _recv_into(sock, memoryview(header))
                tag, total = HEADER.unpack(header)
                r = self._match(k, tag)
                if total > len(r.view) or r.total not in (-1, total):
                    raise TransportError(f"a message of {total} bytes for tag {tag} where {len(r.view)} bytes "
                                         "were expected")
                r.total = total
                offset, length = slices(total, self.streams)[k]
                _recv_into(sock, r.view[offset : offset + length])
                r.work.part_done()
                r = None
        except (OSError, TransportError) as e:
            error = TransportError(f"connection to site {self.rank}: " + (
                f"a TLS record failed authentication ({e.reason}): altered, replayed, cut or injected on the "
                "way (an on-path attacker or a corrupting link)" if isinstance(e, ssl.SSLError) else str(e)))
            self.fail(error)
            if r is not None:  # claimed by this stream, so no longer among the posted ones `fail` ends
                r.work.fail(self.error or error)  # the first error, which `fail` just kept

    def _match(self, k: int, tag: int) -> _Recv:
        """The receive this stream's next slice of `tag` belongs to; waits until it is posted (the
        sender then waits on TCP's window, as gloo's waits for the receiver's buffer)."""
        seq = self.seen[k].get(tag, 0)
        self.seen[k][tag] = seq + 1
        with self.cond:
            while seq not in self.posted.get(tag, {}):
                if self.error is not None:
                    raise self.error
                self.cond.wait(0.5)
            r = self.posted[tag][seq]
            r.claims += 1
            if r.claims == self.streams:  # every stream has its slice: forget it
                del self.posted[tag][seq]
            return r

    def fail(self, error: TransportError) -> None:
        """Every pending and later operation with this peer fails with `error` (the first one)."""
        with self.cond:
            if self.error is None:
                self.error = error
            for by_seq in self.posted.values():
                for r in by_seq.values():
                    r.work.fail(self.error)
            self.posted.clear()
            self.cond.notify_all()
        for k, sock in enumerate(self.socks):
            _drain(self.outbox[k], self.error)
            self.outbox[k].put(None)  # ends the sender (after the send it may be in, which now fails)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Fail what is pending, wake and join this peer's threads (the sockets are shut down, the
        senders get their end marker), then close the sockets: a thread still running at interpreter
        exit is killed wherever it stands (issue 23), so none is left to run then."""
        self.fail(TransportError("the group was closed"))
        me = threading.current_thread()
        for thread in self.threads:
            if thread is not me:  # a finalizer may run on any thread, this peer's own included
                thread.join(JOIN_S)
        for sock in self.socks:
            sock.close()


def _drain(q: queue.SimpleQueue, error: BaseException) -> None:
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return
        if item is not None:
            item[3].fail(error)


# ----------------------------------------------------------------------------------- the group
class Transport:
    """Rank `rank` of `size` members: `listen`, publish `address`, `connect`, then the calls of a c10d
    process group that zeroband uses (`send`, `recv`, `broadcast`, `allreduce`), each returning a
    work whose `wait()` is bounded by `timeout_s` and raises TransportError when a peer is lost."""

    def __init__(self, rank: int, size: int, prefix: str, subkey: bytes | None, timeout_s: float,
                 streams: int | str = 1, host: str | None = None, probe_s: float = 0.0) -> None:
        if streams != AUTO and int(streams) < 1:
            raise ValueError(f"sites.streams={streams}: must be at least 1, or \"auto\"")
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.want, self.probe_s = streams, probe_s  # what the config asked for; the probe's longest transfer
        self.streams = dial_streams(streams, probe_s)  # connections dialed to a peer never probed before
        # sites.insecure (no subkey): plain TCP, with the same bounds; else TLS 1.3 under the group's key
        self.tls = group_tls(group_key(subkey, prefix)) if subkey else None
        self.links: dict[int, LinkProbe] = {}  # peer -> what the probe at `connect` measured
        self.peers: dict[int, _Peer] = {}
        self.accepted: dict[int, dict[int, Conn]] = {}
        self.announced: dict[int, int] = {}  # higher rank -> the streams it dials (its hello says)
        self.rtts: dict[int, list[float]] = {}  # lower rank -> its connects' seconds (`dial`)
        self.cond = threading.Condition()
        # The acceptor holds this object weakly, so a group nobody uses any more is collected and its
        # sockets and threads end (as a c10d group's are when it is dropped, e.g. an old generation's).
        admit = weakref.WeakMethod(self._admit)
        self.acceptor = _Acceptor(host or listen_host(), self.tls, rank, size, lambda *a: (admit() or _refuse)(*a))
        self.address = "{}:{}".format(*self.acceptor.address)
        self.close = weakref.finalize(self, _close_all, self.acceptor, self.peers, self.accepted)

    def _admit(self, src: int, stream: int, streams: int, sock: Conn) -> None:
        with self.cond:
            if src in self.peers or self.announced.setdefault(src, streams) != streams:  # formed, or a dialer
                sock.close()  # that changed its mind: its streams cannot all come now
                return
            slots = self.accepted.setdefault(src, {})
            if stream in slots:  # only a key holder gets here: its dialer gave up on the older one
                slots[stream].close()
            slots[stream] = sock
            self.cond.notify_all()

    def connect(self, addresses: dict[int, str]) -> None:
        """Dial every lower rank (every stream of every peer at once, `_dial_all`) and wait for every
        higher one to dial us; raises PeerTimeout naming the sites still missing after `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        socks: dict[int, list[Conn]] = {}
        try:
            self._dial_all(addresses, deadline, socks)
            with self.cond:
                while missing := [s for s in range(self.rank + 1, self.size)
                                  if len(self.accepted.get(s, {})) < self.announced.get(s, 1 << 30)]:
                    if time.monotonic() > deadline:
                        raise PeerTimeout(self._missing(missing))
                    self.cond.wait(0.1)
                for src, slots in self.accepted.items():
                    socks[src] = [slots.pop(k) for k in range(self.announced[src])]
            self._measure(socks)
        except BaseException:
            for conns in socks.values():
                for sock in conns:
                    sock.close()
            raise
        for peer, conns in socks.items():
            self.peers[peer] = _Peer(peer, conns)

    def _missing(self, missing: list[int]) -> str:
        """Why connecting failed on the accepting side: a flood when this listener refused one, else
        the sites that did not come."""
        waited = f"{_names(missing)} did not connect within {self.timeout_s:g} s (sites.timeout_s)"
        if self.acceptor.refused < FLOOD_REFUSED:
            return f"connecting the group: {waited}"
        return (f"connecting the group under a connection flood: this listener refused {self.acceptor.refusals()}, "
                f"and {waited}")

    def _dial_all(self, addresses: dict[int, str], deadline: float, socks: dict[int, list[Conn]]) -> None:
        """Every stream to every lower rank, dialed at once (DIALS_AHEAD handshakes in flight per
        peer): formation costs the few round trips of one handshake, not of one per stream. A peer
        whose link was probed before gets the streams that probe kept."""
        jobs: list[tuple[int, tuple[str, int], int, int]] = []
        for dst in range(self.rank):
            host, port = addresses[dst].rsplit(":", 1)
            count = dial_streams(self.want, self.probe_s, _LINKS.get((os.getpid(), host)))
            socks[dst] = [cast(Conn, None)] * count
            self.rtts[dst] = []
            jobs += [(dst, (host, int(port)), k, count) for k in range(count)]
        errors: dict[int, BaseException] = {}
        gates = {dst: threading.Semaphore(DIALS_AHEAD) for dst in socks}

        def one(dst: int, address: tuple[str, int], k: int, count: int) -> None:
            with gates[dst]:
                try:
                    socks[dst][k] = self._dial(address, dst, k, count, deadline)
                except BaseException as e:  # raised below, on the caller's thread
                    errors.setdefault(dst, e)

        threads = [threading.Thread(target=one, args=job, name=f"zeroband-dial-{job[0]}.{job[2]}", daemon=True)
                   for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for conns in socks.values():
            conns[:] = [c for c in conns if c is not None]  # what failed: the caller closes the rest
        if errors:
            raise errors[min(errors)]

    def _measure(self, socks: dict[int, list[Conn]]) -> None:
        """Probe every peer's link at once (comm/link.py `probe`: the higher rank initiates, on every
        dialed stream, inside its TLS session) and keep the streams it chose; the rest
        are closed. Without a probe (probe_s 0) every dialed stream is kept. A link probed before
        by this process whose round trip has not moved (`still_measured`) is not measured again:
        the initiator hands the earlier result over in one message, so a generation or a resume in
        a running process forms without the probe's seconds."""
        if self.probe_s <= 0 or not socks:
            return
        results: dict[int, LinkProbe] = {}
        errors: dict[int, BaseException] = {}
        limit = min(self.timeout_s, PROBE_LIMIT_S + 2 * self.probe_s)  # each blocking step of the probe

        def one(peer: int, conns: list[Conn]) -> None:
            try:
                for sock in conns:
                    sock.settimeout(limit)
                key = (os.getpid(), conns[0].getpeername()[0])
                rtts = self.rtts.get(peer, [])  # none on the accepting side: the initiator decides
                known = _LINKS.get(key)
                if not still_measured(known, min(rtts, default=None), len(conns)):
                    known = None  # measured again
                results[peer] = _LINKS[key] = probe(conns, self.rank > peer, cap_s=self.probe_s, known=known,
                                                    choose=lambda r: choose_streams(self.want, r))
                for sock in conns:
                    sock.settimeout(None)
            except (OSError, ProbeError) as e:
                errors[peer] = e

        threads = [threading.Thread(target=one, args=item, name=f"zeroband-probe-{item[0]}", daemon=True)
                   for item in socks.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            peer, e = min(errors.items())
            kind = PeerTimeout if isinstance(e, TimeoutError) else TransportError
            raise kind(f"measuring the link to {_names(sorted(errors))}: {e or type(e).__name__} "
                       f"(each step bounded by {limit:g} s)")
        for peer, result in results.items():
            self.links[peer] = result
            for sock in socks[peer][result.chosen:]:  # dialed for the probe, not needed for the exchange
                sock.close()
            del socks[peer][result.chosen:]

    def _dial(self, address: tuple[str, int], dst: int, stream: int, streams: int, deadline: float) -> Conn:
        """Dialed again until the deadline whenever a handshake fails or is not admitted (no ADMIT: the
        listener dropped it, e.g. at its deadline or restarting), so the acceptor never waits on a
        connection its dialer thinks is up."""
        while True:
            try:
                return dial(address, self.tls, self.rank, dst, stream, streams, deadline - time.monotonic(),
                            self.rtts[dst])
            except (OSError, TransportError) as e:
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"connecting the group: site {dst} at {address[0]}:{address[1]} refused or "
                                      f"dropped every handshake for {self.timeout_s:g} s (last: {e}); it holds "
                                      "another secret or sites.streams, or is not running") from None
                time.sleep(0.05)

    # ---- the process-group calls
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
        work = Work(self.peers[dst].streams, self.timeout_s, f"send to site {dst}")
        self.peers[dst].send(tag, as_bytes(tensors[0]), work)
        return work

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work:
        work = Work(self.peers[src].streams, self.timeout_s, f"receive from site {src}")
        self.peers[src].recv(tag, as_bytes(tensors[0]), work)
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Then:
        root, t = opts.rootRank, tensors[0]
        if self.rank == root:
            return Then([self.send([t], dst, BROADCAST_TAG) for dst in range(self.size) if dst != root])
        return Then([self.recv([t], root, BROADCAST_TAG)])

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Then:
        """Every member's tensor to every other; each sums (or min/max) them in rank order, so every
        member ends with bitwise the same result. For small tensors (statistics, flags)."""
        t = tensors[0]
        own = t.detach().contiguous().clone()
        parts = {r: own if r == self.rank else torch.empty_like(own) for r in range(self.size)}
        works = [self.recv([parts[r]], r, ALLREDUCE_TAG) for r in parts if r != self.rank]
        works += [self.send([own], r, ALLREDUCE_TAG) for r in parts if r != self.rank]
        combine = _combiner(getattr(opts, "reduceOp", dist.ReduceOp.SUM))

        def finish() -> None:
            total = parts[0].clone()
            for r in range(1, self.size):
                total = combine(total, parts[r])
            t.copy_(total)

        return Then(works, finish)



def _close_all(acceptor: _Acceptor, peers: dict[int, _Peer], accepted: dict[int, dict[int, Conn]]) -> None:
    """`Transport.close`, also run when the transport is collected: no socket or thread outlives it."""
    acceptor.close()
    for peer in list(peers.values()):
        peer.close()
    for slots in list(accepted.values()):
        for sock in list(slots.values()):
            sock.close()


# (pid, peer host) -> the last probe of the link to it: what `_measure` may take again; pid: a forked
# child measures its own links
_LINKS: dict[tuple[int, str], LinkProbe] = {}


def _refuse(src: int, stream: int, streams: int, sock: Conn) -> None:
    sock.close()


def _combiner(op: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    ops: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum,
        dist.ReduceOp.PRODUCT: torch.mul}
    for known, fn in ops.items():
        if op == known:
            return fn
    raise ValueError(f"the cross-site transport does not reduce with {op}")


def _names(sites: list[int]) -> str:
    return f"site {sites[0]}" if len(sites) == 1 else f"sites {sites}"
