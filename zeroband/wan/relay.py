"""A TCP relay that holds every byte for a fixed delay each way: one link's round trip on loopback.

The emulator (emulator.py) gives whole sites a WAN, at the cost of namespaces, root and a process
per site. Where a test needs only one peer's connections to cross a real delay, this relay does it
in the test's own process: a client connects to `address`; the relay connects to `target` from
`source` (any local address, e.g. 127.0.0.3, so the target sees another host) at once, then forwards
each chunk read in either direction `delay_s` after it was read, in order; an end of stream is
forwarded the same way (half close). A round trip through it is therefore 2 x delay_s plus loopback.
Two threads per direction per connection: for the few connections of a peer, not for floods.
`tap(src, chunk)`, when given, sees every chunk read, with the socket it came from (a capture), and
what it returns, unless None, is forwarded in the chunk's place (an attacker on the path).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable

CHUNK = 1 << 16


class DelayRelay:
    def __init__(self, target: tuple[str, int], delay_s: float, source: str = "127.0.0.1",
                 host: str = "127.0.0.1", tap: Callable[[socket.socket, bytes], bytes | None] | None = None) -> None:
        self.target, self.delay_s, self.source, self.tap = target, delay_s, source, tap
        self.sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    def _spawn(self, fn: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=fn, args=args, name="zeroband-relay", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10, source_address=(self.source, 0))
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self.socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
                self._spawn(self._read, src, held)
                self._spawn(self._write, dst, held)

    def _read(self, src: socket.socket, held: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        while True:
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            if self.tap is not None and (other := self.tap(src, data)) is not None:
                if data and not other:  # a chunk dropped: nothing to forward (an empty one ends the stream)
                    continue
                data = other
            held.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    def _write(self, dst: socket.socket, held: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        while True:
            due, data = held.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:  # the other end is gone: what is still held goes nowhere
                return

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (closing alone does not)
        except OSError:
            pass
        self.sock.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for thread in self.threads:
            thread.join(1.0)
