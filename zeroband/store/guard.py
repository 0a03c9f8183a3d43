"""An accept-side guard in front of the c10d TCPStore server: idle connections cannot lock it up.

Measured on torch 2.13 (libuv server; the flood test of tests/test_hangs.py):
100 idle TCP connections delay a new client by ~9 s, and 300 or more keep every new client out
(its connect/validate hangs past its own timeout), even after the idle connections are closed.
The server has no setting for this, so the real store listens on an ephemeral loopback port and
this guard owns the public one:

- a connection is forwarded only once it has sent its first bytes (a real c10d client speaks
  at once), so a connection that only opens never reaches the store;
- one that stays silent for `first_byte_s` is closed, and when `max_conns` is reached the oldest
  silent one is closed to make room, so a flood never keeps a real client out, and the guard
  is back to normal as soon as the flood stops;
- forwarded pairs are plain byte pipes (the store protocol is untouched).

One thread, `selectors`; store traffic is small (keys, counters), so a Python hop costs little.
It runs in a process of its own (`python zeroband/store/guard.py`, stdlib only, exits when
its parent does): some c10d client calls (`list_keys`) hold the GIL while they block, so a guard
thread in the same process as such a client would wait for it forever.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections import OrderedDict
from typing import cast

log = logging.getLogger(__name__)

FIRST_BYTE_S = 5.0
MAX_CONNS = 512
SEND_TIMEOUT_S = 10.0


class StoreGuard:
    def __init__(self, host: str, port: int, backend_port: int, first_byte_s: float = FIRST_BYTE_S,
                 max_conns: int = MAX_CONNS) -> None:
        self.backend = ("127.0.0.1", backend_port)
        self.first_byte_s, self.max_conns = first_byte_s, max_conns
        self.listener = _listen(host, port)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.silent: OrderedDict[socket.socket, float] = OrderedDict()  # not yet forwarded, oldest first
        self.peer: dict[socket.socket, socket.socket] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="zeroband-store-guard", daemon=True)

    def start(self) -> StoreGuard:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        for s in [*self.silent, *self.peer, self.listener]:
            s.close()

    @property
    def connections(self) -> int:
        return len(self.silent) + len(self.peer) // 2

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
        elif kind == "silent":
            self._first_bytes(sock)
        else:
            self._pipe(sock)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            if self.connections >= self.max_conns:
                if not self.silent:
                    conn.close()  # every slot holds a live store client: refuse the newcomer
                    continue
                self._close(next(iter(self.silent)))  # the oldest silent connection makes room
            conn.setblocking(False)
            self.silent[conn] = time.monotonic()
            self.sel.register(conn, selectors.EVENT_READ, "silent")

    def _first_bytes(self, conn: socket.socket) -> None:
        data = conn.recv(65536)
        if not data:
            self._close(conn)
            return
        del self.silent[conn]
        store = socket.create_connection(self.backend, timeout=SEND_TIMEOUT_S)
        for s in (conn, store):
            s.settimeout(SEND_TIMEOUT_S)  # sendall below blocks at most this long on a stuck reader
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer[conn], self.peer[store] = store, conn
        self.sel.modify(conn, selectors.EVENT_READ, "pipe")
        self.sel.register(store, selectors.EVENT_READ, "pipe")
        store.sendall(data)

    def _pipe(self, sock: socket.socket) -> None:
        data = sock.recv(65536)
        if not data:
            self._close(sock)
            return
        self.peer[sock].sendall(data)

    def _expire(self, now: float) -> None:
        while self.silent:
            conn, since = next(iter(self.silent.items()))
            if now - since < self.first_byte_s:
                return
            self._close(conn)

    def _close(self, sock: socket.socket) -> None:
        self.silent.pop(sock, None)
        other = self.peer.pop(sock, None)
        for s in (sock, other):
            if s is None:
                continue
            self.peer.pop(s, None)
            try:
                self.sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()


def _listen(host: str, port: int, retry_s: float = 10.0) -> socket.socket:
    """Bind, retrying a few seconds: a run restarted on the same address may find the guard of its
    previous incarnation still closing."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return socket.create_server((host, port), backlog=1024)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux), so the port is free the moment it is."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # elsewhere the ppid poll in main() does it, within half a second
    if os.getppid() != parent:
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="accept-side guard in front of a c10d TCPStore")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend-port", type=int, required=True)
    args = parser.parse_args(argv)
    parent = os.getppid()
    _die_with_parent(parent)
    guard = StoreGuard(args.host, args.port, args.backend_port).start()
    print(f"guard listening on {args.host}:{guard.port}", flush=True)
    while os.getppid() == parent:  # the store dies with its host, and so does its guard
        time.sleep(0.5)
    guard.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
