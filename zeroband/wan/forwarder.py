"""User-space packet forwarder between per-site TUN devices: the WAN when the kernel lacks netem.

Run by `WanEmulator` as `python -m zeroband.wan.forwarder ...`; it is a separate process so that
its packet loop never competes with the parent's GIL, and so that its death (the parent closing
our stdin, or a crash) destroys every TUN device at once: non-persistent TUN devices live exactly
as long as the file descriptors opened here.

Per packet: read from the source site's TUN, look up the destination IPv4 address, drop it with
probability `loss`, then hold it in a heap until `now + delay (+ jitter)` and write it into the
destination site's TUN. Rate limiting is not done here: the kernel's tbf qdisc on each site's
interface caps egress before packets reach us, so this loop only ever carries <= rate.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import itertools
import os
import random
import select
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET = 65536
BATCH = 256  # packets drained per readiness event, so one busy site cannot starve the others


def open_tun(name: str) -> int:
    """A non-persistent layer-3 TUN device `name` (no packet-info header: raw IP packets)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Forwarder:
    def __init__(self, fds: list[int], ips: list[str], delay_s: float, jitter_s: float, loss: float, seed: int) -> None:
        self.route = {socket.inet_aton(ip): fd for ip, fd in zip(ips, fds)}
        self.delay_s, self.jitter_s, self.loss = delay_s, jitter_s, loss
        self.rng = random.Random(seed)
        self.heap: list[tuple[float, int, int, bytes]] = []
        self.seq = itertools.count()  # heap tie-breaker: equal release times keep arrival order
        self.last_release: dict[tuple[int, int], float] = {}
        self.forwarded = self.dropped = 0

    def release_time(self, src: int, dst: int, now: float) -> float:
        """Arrival time of a packet; never before the previous one on the same link, because
        a real WAN path rarely reorders and reordering would make TCP see phantom losses."""
        t = now + self.delay_s
        if self.jitter_s:
            t = max(now, t + self.rng.uniform(-self.jitter_s, self.jitter_s))
        t = max(t, self.last_release.get((src, dst), 0.0))
        self.last_release[(src, dst)] = t
        return t

    def handle(self, src: int, packet: bytes, now: float) -> None:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return  # not IPv4 (IPv6 is disabled on the site interfaces; stray frames are ignored)
        dst = self.route.get(packet[16:20])
        if dst is None or (self.loss and self.rng.random() < self.loss):
            self.dropped += 1
            return
        if not self.delay_s and not self.jitter_s:
            self.write(dst, packet)
            return
        heapq.heappush(self.heap, (self.release_time(src, dst, now), next(self.seq), dst, packet))

    def write(self, fd: int, packet: bytes) -> None:
        try:
            os.write(fd, packet)
            self.forwarded += 1
        except OSError:
            self.dropped += 1  # the destination stack refused it: a loss, as on a real link

    def drain(self, fd: int) -> None:
        now = time.monotonic()
        for _ in range(BATCH):
            try:
                packet = os.read(fd, MAX_PACKET)
            except BlockingIOError:
                return
            self.handle(fd, packet, now)

    def flush_due(self) -> float:
        """Write every packet whose time has come; returns seconds until the next one (-1: none)."""
        now = time.monotonic()
        while self.heap and self.heap[0][0] <= now:
            _, _, fd, packet = heapq.heappop(self.heap)
            self.write(fd, packet)
        return max(0.0, self.heap[0][0] - now) if self.heap else -1.0

    def run(self, control_fd: int) -> None:
        """Forward until `control_fd` (our stdin, a pipe from the emulator) reaches EOF."""
        poller = select.epoll()
        for fd in self.route.values():
            poller.register(fd, select.EPOLLIN)
        poller.register(control_fd, select.EPOLLIN | select.EPOLLHUP)
        timeout = -1.0
        while True:
            for fd, _ in poller.poll(timeout):
                if fd == control_fd:
                    return
                self.drain(fd)
            timeout = self.flush_due()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tun", action="append", required=True, help="TUN device name, one per site")
    p.add_argument("--ip", action="append", required=True, help="site IPv4 address, same order as --tun")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss-pct", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fds = [open_tun(name) for name in args.tun]
    fwd = Forwarder(fds, args.ip, args.delay_ms / 1e3, args.jitter_ms / 1e3, args.loss_pct / 100, args.seed)
    print("ready", flush=True)  # the emulator moves the devices into their namespaces only now
    fwd.run(sys.stdin.fileno())
    print(f"forwarded={fwd.forwarded} dropped={fwd.dropped}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
